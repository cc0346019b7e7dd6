"""Real peers in the test process (a real DHT, real gRPC on port 0) and the helpers the live-peer tests share
(tests/test_live_peers.py, tests/test_live_replicas.py)."""

import asyncio
import dataclasses
import inspect
import re
import socket
import time

import torch
from conftest import record_wire
from hivemind.averaging.control import AveragingStage

from swarm.averaging.config import AveragingConfig
from swarm.compression import get_codec
from swarm.config import RunConfig
from swarm.discovery.dht import DHTConfig, RunDirectory
from swarm.discovery.records import StageRecord
from swarm.model import ModelConfig
from swarm.peer.config import PeerConfig
from swarm.peer.lifecycle import Peer
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.transport.client import PeerClient

MODEL = ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16, num_stages=2)
B, T, D = 2, 16, 32
# One committed loss call of B samples is one optimizer step of the replica that takes it (no warmup: every step
# moves the parameters).
RUN = RunConfig(model=MODEL, target_batch_size=B, warmup_steps=0)
NONE = get_codec("none")
HEARTBEAT_S, TTL_S = 0.3, 2.0


def meta(peer: Peer, microbatch_id: str, **kw) -> pb.RequestMeta:
    return pb.RequestMeta(
        protocol_version=PROTOCOL_VERSION,
        run_id=peer.run_id,
        stage=peer.stage_index,
        codec="none",
        microbatch_id=microbatch_id,
        num_samples=B,
        **kw,
    )


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def hidden(seed: int) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


async def step_last(peer: Peer, steps: int, *, seed: int = 0) -> None:
    """``steps`` committed loss calls of B samples to a last-stage peer: each is one optimizer step there."""
    client = PeerClient(peer.address)
    try:
        for i in range(steps):
            reply = await client.forward(
                meta(peer, f"{peer.peer_id}-{seed}-{i}", compute_loss=True),
                [("input", hidden(seed + i)), ("targets", tokens(seed + i))],
                NONE,
                timeout_s=30,
            )
            await reply.committed
    finally:
        await client.close()
    assert peer.executor.step >= steps


async def get_state(peer: Peer):
    client = PeerClient(peer.address)
    try:
        return await client.get_state(peer.run_id, timeout_s=30)
    finally:
        await client.close()


def params(reply) -> dict[str, torch.Tensor]:
    return {k.removeprefix("param/"): v for k, v in reply.tensors.items() if k.startswith("param/")}


async def assert_one_state(peers: list[Peer]) -> None:
    """Every peer in ``peers`` serves bit-identical parameters (its GetState)."""
    states = [params(await get_state(p)) for p in peers]
    for state in states[1:]:
        assert_same_tensors(state, states[0])


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


async def wait_for_records(directory: RunDirectory, stage: int, want, timeout_s: float = 10.0):
    """Poll the DHT until ``want(records of stage)`` holds (the heartbeat carries the change); the records."""
    deadline = time.monotonic() + timeout_s
    while not want(records := await directory.stage_records(stage)):
        assert time.monotonic() < deadline, records
        await asyncio.sleep(0.05)  # the DHT has no watch: poll a real condition with a deadline
    return records


async def until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition()`` (state another thread or process updates; a coroutine for a read such as the DHT's) until
    it holds, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (await held if inspect.isawaitable(held := condition()) else held):
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)


async def until_step(peer: Peer, step: int, what: str, timeout_s: float = 60.0) -> None:
    """Wait until ``peer`` reached optimizer step ``step`` and its compute thread finished the step check that took
    it there: the step moves mid-check (a state load sets it before the replica drops or hands over its gradient
    sums), so what the check leaves is only settled once it returns."""
    await until(lambda: peer.executor.step >= step, what, timeout_s)
    await peer._worker.compute_urgent(lambda: None)
    assert peer.executor.step == step, f"{what}: went on to step {peer.executor.step}"


def looking_for_group(peer: Peer) -> bool:
    """Whether ``peer``'s averager is in matchmaking for its next all-reduce group."""
    control = peer.executor.optimizer.opt.scheduled_grads
    return control is not None and control.stage == AveragingStage.LOOKING_FOR_GROUP


async def one_microbatch(peer: Peer, seed: int, batch_step: int = 0) -> None:
    """One committed loss call of B samples to a last-stage peer, toward global batch ``batch_step``."""
    client = PeerClient(peer.address)
    try:
        reply = await client.forward(
            meta(peer, f"{peer.peer_id}-mb{seed}", compute_loss=True, batch_step=batch_step),
            [("input", hidden(seed)), ("targets", tokens(seed))],
            NONE,
            timeout_s=30,
        )
        await reply.committed
    finally:
        await client.close()


def live_record(peer: Peer, stage: int = 1) -> StageRecord:
    """An averaging replica's record of ``stage`` at step 0, at ``peer``'s real address (a trainer's view of it)."""
    return dataclasses.replace(
        StageRecord.from_wire(
            record_wire(peer_id=peer.peer_id, stage=stage, step=0, averaging=True)
        ),
        endpoint=peer.address.endpoint,
        tls_cert=peer.address.tls_cert,
    )


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def averaging_replica(run_id: str, boot, **averaging) -> PeerConfig:
    """A replica of stage 1 that averages with its stage (``averaging``: AveragingConfig fields), on DHT ``boot``.
    Through hivemind unless ``all_reduce`` says otherwise: the tests that close batches by hand with a count (no
    group) check hivemind's matchmaking; tests/test_direct_allreduce.py the direct all-reduce."""
    averaging = {"all_reduce": "hivemind", **averaging}
    return PeerConfig(
        run_id=run_id,
        stage=1,
        rebalance=False,
        heartbeat_s=HEARTBEAT_S,
        ttl_s=TTL_S,
        averaging=AveragingConfig(average=True, **averaging),
        dht=DHTConfig(initial_peers=boot),
    )


# A run whose batch never fills by samples: only the trainer's close (CloseBatch) makes a stage step.
CLOSE_DRIVEN_RUN = RunConfig(model=MODEL, target_batch_size=64 * B, warmup_steps=0)
# an averaging replica's log line of stage 1's step 0: how it went and the samples it put in
STEP0_LINE = re.compile(r"stage 1 step 0: (.+?), (\d+) samples in")


async def averaging_replicas(
    n: int, run_id: str, boot, *, run: RunConfig = CLOSE_DRIVEN_RUN, **averaging
) -> list[Peer]:
    """``n`` averaging replicas of stage 1 in this process (``averaging``: AveragingConfig fields), one by one."""
    return [
        await Peer.create(averaging_replica(run_id, boot, **averaging), run=run) for _ in range(n)
    ]
