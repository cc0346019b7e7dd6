"""Shared fixtures and the suite's rules: tiers, root-only tests, an event loop thread for in-process servers,
and local multi-process swarms (swarm.coordinator.localswarm, the harness the benchmarks and `swarm demo` use)."""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
from collections.abc import Iterator

import pytest

from swarm.coordinator.localswarm import LocalSwarm, Where, start_peer

# Tests run several processes on 2 cores: keep each one's torch to a single thread, whatever the caller
# exported (the throughput and timing figures the tests compare assume it).
os.environ["OMP_NUM_THREADS"] = "1"

# --- tiers ------------------------------------------------------------------------------------------------
# Every test is in exactly one tier (README "Three test tiers"), which its module names with
# `pytestmark = pytest.mark.TIER` (a test's own mark overrides it); a module that names none is unit:
#   unit         pure code in this process: codecs, routing math, configs, the simulator;
#   integration  servers, DHT nodes or short CLI subprocesses, started and stopped by the test itself;
#   swarm        several swarm processes (a local swarm) or emulated hosts: seconds to minutes each.
# `make test-fast` runs unit and integration. `slow` (the older name) means swarm; a test that builds network
# namespaces (`netns`) is in the swarm tier whatever its module; a test that starts a local swarm must be in it.
TIERS = ("unit", "integration", "swarm")
SWARM_FIXTURES = {"local_swarm", "module_swarm", "measuring_swarm"}


def _tier_of(item) -> str:
    """The tier marked closest to the test (its own, its class's, its module's); unit if none."""
    tier = "unit"
    for node in reversed(item.listchain()):
        marked = {m.name for m in node.own_markers if m.name in (*TIERS, "slow")}
        marked = {"swarm" if name == "slow" else name for name in marked}
        if len(marked) > 1:
            raise pytest.UsageError(
                f"{item.nodeid} is marked {sorted(marked)}: a test is in exactly one tier"
            )
        if marked:
            tier = marked.pop()
            break
    if any(item.get_closest_marker(m) is not None for m in ("netns", "nat", "docker")):
        tier = "swarm"
    if tier != "swarm" and SWARM_FIXTURES & set(getattr(item, "fixturenames", ())):
        raise pytest.UsageError(
            f"{item.nodeid} starts a local swarm but is in the {tier} tier: mark its module "
            "`pytestmark = pytest.mark.swarm`"
        )
    return tier


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        tier = _tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)


# CI runs as root: there a test that needs network namespaces (`netns`) or a Docker engine it installs and starts
# (`docker`) must run, and one that cannot is a failure, not a green skip (the slow-link claim rests on
# tests/test_netswarm.py, the compose demo's on tests/test_compose_live.py). Elsewhere it skips with the reason.
REQUIRE_ROOT_ENV = "SWARM_REQUIRE_ROOT_TESTS"


@functools.cache
def netns_unavailable() -> str | None:
    """Why this process cannot build network namespaces (None when it can); asked once per session."""
    if sys.platform != "linux":
        return "needs Linux"
    from deploy.netns import have_netns

    available, why = have_netns()
    return None if available else why


@functools.cache
def nat_unavailable() -> str | None:
    """Why this process cannot build NAT routers in network namespaces (None when it can)."""
    if (why := netns_unavailable()) is not None:
        return why
    from deploy.netns import have_nat

    available, why = have_nat()
    return None if available else why


@functools.cache
def docker_unavailable() -> str | None:
    """Why this process cannot install and start a Docker engine (None when it can); asked once per session
    (it may ask the package registry: deploy/engine.py)."""
    from deploy.engine import why_unavailable

    return why_unavailable()


def require_root_tests() -> bool:
    return os.environ.get(REQUIRE_ROOT_ENV, "") not in ("", "0")


# marker -> (what it needs, in words; why this process lacks it, or None)
ROOT_MARKERS = {
    "netns": ("network namespaces", lambda: netns_unavailable()),
    "nat": ("NAT routers in network namespaces", lambda: nat_unavailable()),
    "docker": ("a Docker engine", lambda: docker_unavailable()),
}


def pytest_runtest_setup(item) -> None:
    for marker, (what, unavailable) in ROOT_MARKERS.items():
        if item.get_closest_marker(marker) is None or (why := unavailable()) is None:
            continue
        reason = f"{what} unavailable: {why}"
        if require_root_tests():
            pytest.fail(
                f"{reason} ({REQUIRE_ROOT_ENV} is set: CI must run this test)", pytrace=False
            )
        pytest.skip(reason)


def drain_peer(proc, *, bound_s: float = 30.0) -> None:
    """Stop a peer process with SIGTERM (a drain) and check that it exits cleanly within ``bound_s`` (the default
    ``--drain-timeout-s``)."""
    import signal
    import time

    t0 = time.monotonic()
    proc.signal(signal.SIGTERM)
    code = proc.popen.wait(timeout=2 * bound_s)
    took = time.monotonic() - t0
    assert code == 0 and took <= bound_s, (proc.name, code, took)


def ask_peers(endpoints, call):
    """``call(client)`` against each endpoint in turn (a fresh PeerClient each, closed after); the results in
    order. Synchronous, for tests that drive peer processes from the outside: an endpoint string is resolved by
    ``address_by_handshake`` (trust on first use, fine for the test's own peers)."""
    from swarm.transport.client import PeerClient
    from swarm.transport.security import address_by_handshake

    async def go():
        out = []
        for endpoint in endpoints:
            if isinstance(endpoint, str):
                endpoint = await asyncio.to_thread(address_by_handshake, endpoint)
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
    slowdown, compute; ``device``: where the stage is built, default the CPU)."""
    from swarm.model import build_stage
    from swarm.optim import LocalStageOptimizer
    from swarm.peer.executor import StageExecutor

    stage_module = build_stage(run.model, stage_index, device=kwargs.pop("device", "cpu"))
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


# The run of the multi-process swarm tests whose replicas step on their own (--no-average): batches of 16
# samples are too small to pay for an all-reduce each; tests/test_averaging.py covers replicas that average.
SOLO_PEER_FLAGS = [
    "--preset",
    "tiny",
    "--target-batch-size",
    "16",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "5",
    "--no-average",
]


def peers_on_hosts(group, run_id: str, addr_file, *run_flags: str):
    """A starter of ``run_id``'s peers, each in a host's network namespace (deploy.netns.EmulatedNetwork):
    ``peer(name, host, stage, *more_flags)`` returns the started process."""

    def peer(name: str, host, stage: int, *flags: str):
        return start_peer(
            group,
            name,
            stage=stage,
            run_id=run_id,
            addr_file=addr_file,
            where=Where.on(host),
            run_flags=[*run_flags, *flags],
        )

    return peer


def status_on_host(host, run_id: str, addr_file) -> dict:
    """``swarm status --json`` of ``run_id`` run inside ``host``'s network namespace, as a user there runs it:
    the document (schema: swarm.coordinator.status)."""
    import json

    status = host.run(
        [sys.executable, "-m", "swarm", "status", "--run-id", run_id, "--json"]
        + ["--initial-peers", f"@{addr_file}"],
        timeout_s=120,
    )
    return json.loads(status.stdout.splitlines()[-1])


# The trainer options the swarm tests share (TrainerConfig names): microbatches of 8, validation only at the
# end, and a progress line per step, which tests wait on ("step N/").
TEST_TRAINER = dict(microbatch_size=8, eval_every_steps=0, log_every_s=0)


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the test item (``item.report_call``...): fixtures read whether the test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


# What a failed swarm test prints of each process's log: CI keeps only pytest's output, not the logs.
LOG_TAIL_LINES, LOG_LINE_CHARS = 40, 400


def print_log_tails(directory) -> None:
    """The last lines of every log under ``directory`` (captured: pytest shows them with the failure)."""
    for log in sorted(directory.rglob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        print(f"----- {log.relative_to(directory)} (last {len(lines)} lines)")
        for line in lines:
            print(line[:LOG_LINE_CHARS])


@pytest.fixture
def local_swarm(tmp_path, request) -> Iterator[LocalSwarm]:
    swarm = LocalSwarm(tmp_path)
    try:
        yield swarm
    finally:
        swarm.close()
        report = getattr(request.node, "report_call", None)
        if report is not None and report.failed:
            print_log_tails(tmp_path)


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


def even_split_lower_bound(draws: int, sigmas: float = 3.0) -> float:
    """The share one of two peers gets from ``draws`` fair coin flips, less ``sigmas`` standard deviations:
    0.5 - sigmas * sqrt(0.25 / draws). Work routed by speed between two peers is a sequence of weighted
    draws; a share below this bound says "clearly less than half" with the chance of a fair coin doing it by
    luck under 0.14% (3 sigmas, normal approximation), whatever the machine's load did to the timings."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    return 0.5 - sigmas * (0.25 / draws) ** 0.5


# ---- real peers in the test process (tests/test_live_peers.py)


@pytest.fixture(scope="module")
def boot():
    """A bootstrap DHT node for the module: every test joins it with its own run id."""
    from swarm.discovery.dht import DHTConfig, start_dht, visible_addresses

    dht = start_dht(DHTConfig())
    yield tuple(visible_addresses(dht))
    dht.shutdown()


@pytest.fixture
def peers(loop_thread, boot):
    """Start peers with ``start(run_id, stage, **PeerConfig fields)``; whatever is still running at the end is
    shut down (no drain). The peers run ``livepeers.RUN`` (tests/livepeers.py holds the helpers). They do not
    average unless a test says so (``averaging=AveragingConfig(...)``): these tests count one optimizer step per
    untagged commit, the contract of a replica that steps alone."""
    from livepeers import HEARTBEAT_S, RUN, TTL_S

    from swarm.averaging.config import AveragingConfig
    from swarm.discovery.dht import DHTConfig
    from swarm.peer.config import PeerConfig
    from swarm.peer.lifecycle import Peer

    started: list[Peer] = []

    def start(run_id: str, stage: int, *, run=None, **fields) -> Peer:
        """``run``: the run to serve, default ``livepeers.RUN``."""
        fields = {
            "heartbeat_s": HEARTBEAT_S,
            "ttl_s": TTL_S,
            "rebalance": False,
            "averaging": AveragingConfig(average=False),
            **fields,
        }
        config = PeerConfig(run_id=run_id, stage=stage, dht=DHTConfig(initial_peers=boot), **fields)
        peer = loop_thread.run(Peer.create(config, run=run or RUN))
        started.append(peer)
        return peer

    yield start
    for peer in started:
        if not peer.stopped.is_set():
            loop_thread.run(peer.shutdown())
