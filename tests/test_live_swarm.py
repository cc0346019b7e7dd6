"""What the README says of live peers that needs a killed process or averaging replicas: periodic checkpoints are
written without any drain and a peer killed with SIGKILL resumes from the last one; `swarm train
--max-batches-ahead N` keeps the trainer within N batches of the stages."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request

import pytest
import torch
from conftest import ask_peers
from prometheus_client.parser import text_string_to_metric_families

from swarm.averaging.config import AveragingConfig
from swarm.compression import get_codec
from swarm.config import RunConfig
from swarm.data import DataConfig
from swarm.discovery.dht import DHTConfig
from swarm.model import MODEL_PRESETS, ModelConfig
from swarm.peer.checkpoint import CheckpointStore
from swarm.peer.config import PeerConfig
from swarm.peer.lifecycle import Peer
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.trainer.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.slow

NONE = get_codec("none")


# ---------------------------------------------------------------------------------------------- checkpoints

TINY = MODEL_PRESETS["tiny"]
B = 2
# One committed loss call of B samples is one optimizer step of the last stage's replica (which steps alone).
CKPT_RUN = RunConfig(model=TINY, target_batch_size=B, warmup_steps=0)
CKPT_FLAGS = [
    *("--preset", "tiny", "--target-batch-size", str(B), "--warmup-steps", "0"),
    "--no-average",
]


def _loss_step(endpoint: str, run_id: str, i: int) -> None:
    """One committed loss call to the last stage of a ``tiny`` run: one optimizer step there."""
    generator = torch.Generator().manual_seed(i)
    x = torch.randn(B, TINY.seq_len, TINY.d_model, generator=generator)  # (B, T, D)
    targets = torch.randint(0, 256, (B, TINY.seq_len), generator=generator)  # (B, T)
    request = pb.RequestMeta(
        protocol_version=PROTOCOL_VERSION,
        run_id=run_id,
        stage=1,
        codec="none",
        microbatch_id=f"mb-{i}",
        num_samples=B,
        compute_loss=True,
    )

    async def call(client):
        reply = await client.forward(
            request, [("input", x), ("targets", targets)], NONE, timeout_s=60
        )
        await reply.committed

    ask_peers([endpoint], call)


def _state(endpoint: str, run_id: str):
    return ask_peers([endpoint], lambda client: client.get_state(run_id, timeout_s=30))[0]


def _wait_for_checkpoint(store: CheckpointStore, step: int, timeout_s: float = 30.0) -> dict:
    """Poll the checkpoint file (written atomically by the peer's step loop) until it holds ``step``."""
    deadline = time.monotonic() + timeout_s
    while True:
        saved = store.load(1, run=CKPT_RUN)
        if saved is not None and saved["step"] == step:
            return saved
        assert time.monotonic() < deadline, None if saved is None else saved["step"]
        time.sleep(0.05)  # another process writes the file: poll it with a deadline


def test_periodic_checkpoints_without_a_drain_and_a_killed_peer_resumes_from_the_last(
    local_swarm, tmp_path
):
    run_id, every = "ckpt-kill", 2
    store = CheckpointStore(tmp_path / "ckpt")
    flags = [
        *CKPT_FLAGS,
        "--checkpoint-dir",
        str(store.directory),
        "--checkpoint-every-steps",
        str(every),
        "--no-rebalance",
        "--drain-notice-s",
        "0.2",  # the teardown's SIGTERM then ends it at once: nothing is in flight
    ]
    proc = local_swarm.peer("first", 1, *flags, run_id=run_id, wait=False)
    endpoint = local_swarm.wait_ready(proc)
    at_step = {}
    for i in range(5):
        _loss_step(endpoint, run_id, i)
        step = i + 1
        if step % every == 0:
            # Waited for before the next step, so the step loop sees exactly this step.
            saved = _wait_for_checkpoint(store, step)
            reply = _state(endpoint, run_id)
            assert reply.meta.step == step
            at_step[step] = {k.removeprefix("param/"): v for k, v in reply.tensors.items()}
            for name, tensor in at_step[step].items():
                assert torch.equal(saved["params"][name], tensor), name
    assert sorted(at_step) == [2, 4]
    assert _state(endpoint, run_id).meta.step == 5
    proc.signal(signal.SIGKILL)  # no drain, so no checkpoint but the periodic ones
    assert proc.popen.wait(timeout=30) == -signal.SIGKILL
    assert store.load(1, run=CKPT_RUN)["step"] == 4

    endpoint = local_swarm.wait_ready(
        local_swarm.peer("restarted", 1, *flags, run_id=run_id, wait=False)
    )
    resumed = _state(endpoint, run_id)
    assert resumed.meta.step == 4
    params = {k.removeprefix("param/"): v for k, v in resumed.tensors.items()}
    assert sorted(params) == sorted(at_step[4])
    for name, tensor in at_step[4].items():
        assert torch.equal(params[name], tensor), name


# ---------------------------------------------------------------------------------------------- flow control

MODEL = ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16, num_stages=2)
MICROBATCH, PER_STEP = 8, 2
QUIET_S = 1.0  # the averaging stages below step only after this long without a commit
AVG_RUN = RunConfig(model=MODEL, target_batch_size=MICROBATCH * PER_STEP, warmup_steps=0)


@pytest.fixture(scope="module")
def averaging_stages(loop_thread):
    """One averaging replica (--average) per stage, in this process, each with a spy on its commits: (stage, the
    commit's batch step, the replica's step when the commit lands), in order. The spy only records: it calls
    the executor's own commit on the compute thread that owns the step, so the step it reads is exact."""
    commits: list[tuple[int, int | None, int]] = []

    def config(stage: int, initial_peers=()) -> PeerConfig:
        return PeerConfig(
            run_id="ahead",
            stage=stage,
            rebalance=False,
            heartbeat_s=0.5,
            ttl_s=3.0,
            averaging=AveragingConfig(average=True, matchmaking_s=1.0),
            dht=DHTConfig(initial_peers=initial_peers),
        )

    async def start():
        first = await Peer.create(config(0), run=AVG_RUN)
        last = await Peer.create(config(1, tuple(first.addresses())))
        return [first, last]

    peers = loop_thread.run(start())
    for peer in peers:
        executor = peer.executor
        commit, maybe_step = executor.commit, executor.maybe_step
        last_commit = [0.0]

        def spy(
            microbatch_id, batch_step=None, *, commit=commit, executor=executor, last=last_commit
        ):
            commits.append((executor.stage_index, batch_step, executor.step))
            last[0] = time.monotonic()
            return commit(microbatch_id, batch_step)

        def quiet_step(*, maybe_step=maybe_step, last=last_commit):
            # A stage steps only once no commit has come for QUIET_S (a slow all-reduce, made certain): a trainer
            # allowed ahead commits its next batch before the stage steps, one held back does not.
            return False if time.monotonic() - last[0] < QUIET_S else maybe_step()

        executor.commit, executor.maybe_step = spy, quiet_step
    yield peers, commits
    for peer in peers:
        loop_thread.run(peer.shutdown())


def _trainer_config(ahead: int, steps: int, **options) -> TrainerConfig:
    """A trainer of the averaging stages' run: ``steps`` batches, at most ``ahead`` ahead of the stages."""
    return TrainerConfig(
        run_id="ahead",
        microbatch_size=MICROBATCH,
        # room for two batches at once: only the flow control holds it back
        in_flight=2 * PER_STEP,
        steps=steps,
        max_batches_ahead=ahead,
        eval_every_steps=0,
        eval_batches=1,
        log_every_s=60,
        data=DataConfig(),
        **options,
    )


def _train(peers, ahead: int, steps: int):
    async def go():
        async with Trainer.open(_trainer_config(ahead, steps), dht=peers[0].dht) as trainer:
            return await trainer.train()

    return go()


@pytest.mark.parametrize("ahead", [0, 1])
def test_the_trainer_stays_within_max_batches_ahead_of_the_stages(
    averaging_stages, loop_thread, ahead
):
    peers, commits = averaging_stages
    steps = 4
    first_steps = [peer.executor.step for peer in peers]
    del commits[:]
    summary = loop_thread.run(_train(peers, ahead, steps), timeout_s=300)
    assert summary.steps == steps and summary.microbatches == steps * PER_STEP

    async def stepped():
        deadline = time.monotonic() + 30
        while [p.executor.step for p in peers] != [s + steps for s in first_steps]:
            assert time.monotonic() < deadline, [p.executor.step for p in peers]
            await asyncio.sleep(0.05)

    loop_thread.run(stepped())
    # Every microbatch committed once at every stage, tagged with its global batch ...
    for stage, first in enumerate(first_steps):
        tags = sorted(batch for s, batch, _ in commits if s == stage)
        assert tags == sorted(first + b for b in range(steps) for _ in range(PER_STEP))
    # ... and none arrived more than `ahead` batches past the step its stage had taken.
    leads = [batch - step for _, batch, step in commits]
    assert max(leads) <= ahead, commits
    assert min(leads) >= 0, commits  # a stage never steps past a batch it has not received
    if ahead:
        assert max(leads) == ahead, (
            commits
        )  # the trainer did use its lead: the bound is what held it


def test_a_trainers_metrics_endpoint_and_tensorboard_log_report_what_its_summary_says(
    averaging_stages, loop_thread, tmp_path
):
    peers, _ = averaging_stages

    async def go():
        config = _trainer_config(0, 2, metrics_port=0, tensorboard_dir=str(tmp_path / "tb"))
        async with Trainer.open(config, dht=peers[0].dht) as trainer:
            summary = await trainer.train()
            url = f"http://127.0.0.1:{trainer.metrics_port}/metrics"
            page = await asyncio.to_thread(urllib.request.urlopen, url, timeout=10)
            return summary, trainer.trainer_id, page.read().decode()

    summary, trainer_id, text = loop_thread.run(go(), timeout_s=300)
    # The TensorBoard events (read back with tensorboard's own reader) hold each step's loss and the validation.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logdir,) = (tmp_path / "tb" / "ahead").iterdir()
    assert logdir.name.startswith(f"{trainer_id}-")
    events = EventAccumulator(str(logdir))
    events.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    assert [step for step, _ in scalars["train/loss"]] == [1, 2]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(summary.losses, rel=1e-6)
    assert scalars["val/loss"][-1] == (2, pytest.approx(summary.val_loss, rel=1e-6))
    assert all(v > 0 for _, v in scalars["train/tokens_per_s"])
    assert scalars["pipeline/unconfirmed_commits"][-1][1] == summary.unconfirmed_commits == 0
    labels = (("run_id", "ahead"), ("trainer_id", trainer_id))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("swarm_trainer_step", labels)] == summary.steps == 2
    assert samples[("swarm_trainer_microbatches_total", labels)] == summary.microbatches
    assert samples[("swarm_trainer_samples_total", labels)] == summary.samples
    assert samples[("swarm_trainer_loss", labels)] == pytest.approx(summary.losses[-1])
    assert samples[("swarm_trainer_unconfirmed_commits_total", labels)] == 0
    assert samples[("swarm_trainer_tokens_per_second", labels)] > 0
