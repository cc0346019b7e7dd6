"""Shared fixtures: an event loop thread for in-process servers, and local multi-process swarms."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.coordinator.launcher import ProcessGroup

# Tests run several processes on 2 cores: keep each one's torch to a single thread, whatever the caller
# exported (the throughput and timing figures the tests compare assume it).
os.environ["OMP_NUM_THREADS"] = "1"


def ask_peers(endpoints, call):
    """``call(client)`` against each endpoint in turn (a fresh PeerClient each, closed after); the results in
    order. Synchronous, for tests that drive peer processes from the outside."""
    from swarm.transport.client import PeerClient

    async def go():
        out = []
        for endpoint in endpoints:
            client = PeerClient(endpoint)
            try:
                out.append(await call(client))
            finally:
                await client.close()
        return out

    return asyncio.run(go())


def record_wire(**overrides) -> dict:
    """A valid stage record as the DHT carries it (a serving peer of stage 0 at step 3), with ``overrides``."""
    base = dict(
        peer_id="p",
        endpoint="127.0.0.1:1",
        stage=0,
        state="serving",
        throughput=10.0,
        in_flight=0,
        step=3,
        config_hash="abc",
    )
    return {**base, **overrides}


def local_executor(run, stage_index: int, **kwargs):
    """A StageExecutor of ``stage_index`` that steps alone, as one built outside a peer (``kwargs``: cache,
    slowdown)."""
    from swarm.model import build_stage
    from swarm.optim import LocalStageOptimizer
    from swarm.peer.executor import StageExecutor

    stage_module = build_stage(run.model, stage_index)
    return StageExecutor(
        stage_module, run, optimizer=LocalStageOptimizer(stage_module, run), **kwargs
    )


class LoopThread:
    """An asyncio loop running in a thread, so servers outlive one test's coroutine (module fixtures)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


class LocalSwarm:
    """A bootstrap DHT node and peers as separate processes; every process is stopped at teardown."""

    def __init__(self, workdir: Path):
        self.group = ProcessGroup(workdir)
        self.addr_file = workdir / "bootstrap.addr"
        self.group.swarm("bootstrap", "dht", "--address-file", str(self.addr_file))

    @property
    def initial_peers(self) -> list[str]:
        return ["--initial-peers", f"@{self.addr_file}"]

    def peer(self, name: str, stage: int, *args: str, run_id: str = "test", wait: bool = True):
        proc = self.group.swarm(
            name, "peer", "--run-id", run_id, "--stage", str(stage), *self.initial_peers, *args
        )
        if wait:
            self.wait_ready(proc)
        return proc

    @staticmethod
    def wait_ready(proc, timeout_s: float = 120.0) -> str:
        """Wait for the peer's ready line; return its gRPC endpoint."""
        return proc.wait_for(
            r"serves stage \d+ of run '[^']+' at (\S+)", timeout_s=timeout_s
        ).group(1)

    def addresses(self) -> list[str]:
        self.group.procs["bootstrap"].wait_for("DHT node is up", timeout_s=60)
        return [line.strip() for line in self.addr_file.read_text().splitlines() if line.strip()]

    def stop_peers(self) -> None:
        """Stop every process but the bootstrap node, together (a frozen one is resumed first so it can drain)."""
        names = [
            name for name, proc in self.group.procs.items() if name != "bootstrap" and proc.alive()
        ]
        for name in names:
            self.group.procs[name].signal(signal.SIGCONT)
        self.group.stop_all(names, timeout_s=30)

    def close(self) -> None:
        self.group.close()


@pytest.fixture(scope="module")
def module_swarm(tmp_path_factory) -> Iterator[LocalSwarm]:
    """One bootstrap node for a whole test module (starting one costs seconds)."""
    swarm = LocalSwarm(tmp_path_factory.mktemp("swarm"))
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.fixture
def measuring_swarm(module_swarm) -> Iterator[LocalSwarm]:
    """The module's swarm, with this test's peers stopped after it: idle peers of an earlier test would take
    CPU from the next test's throughput measurements on 2 cores."""
    yield module_swarm
    module_swarm.stop_peers()


@pytest.fixture
def local_swarm(tmp_path) -> Iterator[LocalSwarm]:
    swarm = LocalSwarm(tmp_path)
    try:
        yield swarm
    finally:
        swarm.close()


STAGE = 3  # the stage index the routing tests use


def measured_router(rates: dict[str, float], **config):
    """A router whose peers of STAGE each have one measured round trip at the given rate."""
    from swarm.routing import Router, RoutingConfig

    router = Router(RoutingConfig(**config))
    router.update_peers(STAGE, {peer: 1.0 for peer in rates}, now=0.0)
    for peer, rate in rates.items():
        router.on_start(STAGE, peer, 0.0)
        router.on_success(STAGE, peer, size=8.0, elapsed_s=8.0 / rate, now=0.0)
    return router


def sample_tensor(distribution: str, numel: int = 1 << 16, seed: int = 0):
    """A float32 (numel,) tensor of a named distribution: normal, student_t2 (heavy tails), lognormal."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(numel, generator=generator)  # (N,)
    if distribution == "normal":
        return normal
    if distribution == "student_t2":
        # t(2) = Z / sqrt(chi2(2) / 2), chi2(2) = -2 log U: heavy tails with infinite variance
        uniform = torch.rand(numel, generator=generator).clamp_min_(1e-12)
        return normal / torch.sqrt(-torch.log(uniform))
    if distribution == "lognormal":
        return normal.exp()
    raise AssertionError(distribution)


def relative_error(original, decoded) -> float:
    """||original - decoded|| / ||original||, in float64."""
    original, decoded = original.double(), decoded.double()
    return float((original - decoded).norm() / original.norm())
