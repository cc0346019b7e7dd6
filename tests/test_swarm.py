"""Multi-process swarms: separate peer processes found through a real DHT, talking real gRPC."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch
from conftest import SOLO_PEER_FLAGS, TEST_TRAINER, ask_peers

from swarm.config import RunConfig
from swarm.coordinator.localswarm import finished, read_peer_addresses
from swarm.discovery.dht import DHTConfig, RunDirectory, start_dht
from swarm.model import ModelConfig, build_full_model
from swarm.trainer.pipeline import Pipeline
from swarm.transport.client import PeerClient

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def swarm(module_swarm):
    return module_swarm


@pytest.fixture(scope="module")
def dht(swarm):
    node = start_dht(DHTConfig(initial_peers=tuple(swarm.addresses())), client_mode=True)
    yield node
    node.shutdown()


@pytest.mark.parametrize("num_stages", [2, 3])
def test_split_across_peer_processes_matches_one_process(swarm, dht, num_stages):
    """Loss and every parameter gradient of the split model equal the unsplit model's (codec none)."""
    model = ModelConfig(
        d_model=32, n_heads=2, n_layers=3, seq_len=16, num_stages=num_stages, seed=7
    )
    # no optimizer step: compare raw gradients
    run = RunConfig(model=model, target_batch_size=10**6)
    run_id = f"equiv{num_stages}"
    directory = RunDirectory(dht, run_id)
    asyncio.run(directory.publish_run(run, ttl_s=600))
    procs = [swarm.peer(f"{run_id}-s{k}", k, run_id=run_id, wait=False) for k in range(num_stages)]
    endpoints = [swarm.wait_ready(p) for p in procs]
    tokens = torch.randint(
        0, 256, (4, model.seq_len + 1), generator=torch.Generator().manual_seed(3)
    )

    async def remote():
        pipeline = Pipeline(directory, run)
        await pipeline.start()
        try:
            await pipeline.wait_for_peers(timeout_s=60)
            result = await pipeline.train_microbatch("mb-1", tokens)
        finally:
            await pipeline.close()
        states = []
        for address in await read_peer_addresses(directory, endpoints):
            client = PeerClient(address)
            states.append(await client.get_state(run_id, include_grads=True, timeout_s=30))
            await client.close()
        return result, states

    result, states = asyncio.run(remote())
    full = build_full_model(model)
    loss = full.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    # Stated tolerance: fp32 on both sides, same kernels; differences come from summation order only.
    assert result.loss == pytest.approx(float(loss), rel=1e-5, abs=1e-6)
    for k, state in enumerate(states):
        samples = state.meta.samples_accumulated
        assert samples == tokens.shape[0]
        for name, p in full.stages[k].named_parameters():
            # peers keep sums weighted by samples
            remote_grad = state.tensors[f"grad/{name}"] / samples
            torch.testing.assert_close(
                remote_grad, p.grad, rtol=1e-4, atol=1e-6, msg=f"stage {k} {name}"
            )
            torch.testing.assert_close(state.tensors[f"param/{name}"], p.detach(), rtol=0, atol=0)
    swarm.group.stop_all([proc.name for proc in procs])


def test_two_stages_two_peers_each_train_and_loss_falls(swarm, tmp_path):
    """2 stages x 2 peer processes + a trainer process: loss falls, every peer works, all processes exit.
    The replicas step on their own here (--no-average): batches of 16 samples are too small to pay for an
    all-reduce each; tests/test_averaging.py covers the replicas that average."""
    run_id = "train"
    flags = SOLO_PEER_FLAGS
    procs = [
        swarm.peer(f"train-s{k}-{r}", k, *flags, run_id=run_id, wait=False)
        for k in (0, 1)
        for r in (0, 1)
    ]
    endpoints = [swarm.wait_ready(p) for p in procs]
    metrics = tmp_path / "metrics.jsonl"
    trainer = swarm.trainer(
        "trainer",
        run_id=run_id,
        **TEST_TRAINER,
        steps=30,
        in_flight=4,
        eval_batches=2,
        metrics_path=metrics,
    )
    summary = finished(trainer, timeout_s=300)
    initial, final, val = summary.initial_loss, summary.final_loss, summary.val_loss
    assert 5.0 < initial < 6.0  # ~ln(256) for an untrained byte model
    assert final < 0.8 * initial and val < 0.85 * initial
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 31))

    infos = ask_peers(endpoints, lambda client: client.info(run_id, timeout_s=10))
    applied = [info.microbatches_applied for info in infos]
    # 30 steps x 2 microbatches each went through both stages; randomized wiring spreads them over replicas.
    assert sum(applied[:2]) == 60 and sum(applied[2:]) == 60
    assert all(n > 0 for n in applied), applied
    swarm.group.stop_all([proc.name for proc in procs], timeout_s=40)
    for proc in procs:
        assert proc.popen.returncode == 0, proc.log_path.read_text()[-2000:]
    assert all(not re.search("Traceback", p.log_path.read_text()) for p in procs)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_push_mode_trains_and_loss_falls(swarm, num_stages):
    """Activations pushed peer to peer (`swarm train --activations push`), one peer process per stage: the loss
    falls, each stage counts every microbatch once, and all processes exit cleanly."""
    run_id = f"push{num_stages}"
    flags = [*SOLO_PEER_FLAGS, "--num-stages", str(num_stages)]
    procs = [
        swarm.peer(f"{run_id}-s{k}", k, *flags, run_id=run_id, wait=False)
        for k in range(num_stages)
    ]
    endpoints = [swarm.wait_ready(p) for p in procs]
    trainer = swarm.trainer(
        f"{run_id}-trainer",
        run_id=run_id,
        **TEST_TRAINER,
        steps=30,
        in_flight=4,
        eval_batches=2,
        activations="push",
    )
    summary = finished(trainer, timeout_s=400)
    assert summary.microbatches == summary.microbatches_started == 60
    # (one CI run of 2 stages validated at 5.19 after training to 3.29, where runs here give 3.3: the logs, if again)
    assert (
        summary.final_loss < 0.8 * summary.initial_loss
        and summary.val_loss < 0.85 * summary.initial_loss
    ), _what_they_said(trainer, procs)
    infos = ask_peers(endpoints, lambda client: client.info(run_id, timeout_s=10))
    assert [info.microbatches_applied for info in infos] == [60] * num_stages
    swarm.group.stop_all([proc.name for proc in procs], timeout_s=40)
    for proc in procs:
        assert proc.popen.returncode == 0, proc.log_path.read_text()[-2000:]
    assert all(not re.search("Traceback", p.log_path.read_text()) for p in procs)


def _what_they_said(trainer, procs) -> str:
    """For a failure's reader: the trainer's last lines and each peer's warnings."""
    said = [f"--- {trainer.name}", trainer.log_path.read_text()[-3000:]]
    for proc in procs:
        lines = proc.log_path.read_text().splitlines()
        said += [f"--- {proc.name}", *[line for line in lines if " WARN" in line][-15:]]
    return "\n".join(said)
