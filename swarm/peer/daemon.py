"""The peer daemon: serves one stage of one run, announces itself in the DHT, drains on SIGTERM.

Built in small steps (``Peer.create``), each registering its own cleanup on an AsyncExitStack, so a peer
that fails half-way through starting still releases what it took, and shutdown needs no guards.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from dataclasses import dataclass, field

import torch

from swarm.config import RunConfig
from swarm.discovery.dht import DHTConfig, RunDirectory, start_dht, visible_addresses
from swarm.discovery.records import StageRecord
from swarm.errors import TransportError
from swarm.model import build_stage
from swarm.peer.executor import CacheConfig, StageExecutor
from swarm.peer.worker import URGENT, PriorityWorker
from swarm.transport.server import start_server

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    run_id: str = "demo"  # the run to join
    stage: int = 0  # stage index this peer serves
    host: str = "127.0.0.1"  # address the gRPC server and the DHT listen on (0.0.0.0 for all interfaces)
    port: int = 0  # gRPC port (0 = any free port)
    announce_host: str | None = None  # address others should dial, if not --host
    peer_id: str | None = None  # stable identity (default: random per start)
    threads: int = 1  # torch intra-op threads for this peer's compute
    heartbeat_s: float = 1.0  # seconds between DHT announcements
    ttl_s: float = 5.0  # announcement lifetime: a silent peer disappears from routing after this
    drain_timeout_s: float = 30.0  # on SIGTERM, exit within this many seconds
    drain_notice_s: float = 3.0  # after SIGTERM, keep accepting forwards this long while trainers learn of it
    max_microbatch_size: int = 256  # most samples accepted in one request
    calibration_batch: int = 8  # samples used to time the stage at startup
    slowdown: float = 1.0  # fault injection: make every compute this many times slower (1 = off)
    fail_probability: float = 0.0  # fault injection: answer this share of calls with an error (0 = off)
    hang_after_calls: int = 0  # fault injection: stop answering (hang) after this many calls (0 = off)
    dht: DHTConfig = field(default_factory=DHTConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self):
        if self.stage < 0:
            raise ValueError(f"stage must be >= 0, got {self.stage}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(f"need 0 < heartbeat_s < ttl_s, got heartbeat_s={self.heartbeat_s}, ttl_s={self.ttl_s}")
        if self.slowdown < 1:
            raise ValueError(f"slowdown is a factor >= 1 (1 = normal speed), got {self.slowdown}")
        if not 0 <= self.fail_probability <= 1 or self.hang_after_calls < 0:
            raise ValueError(f"fail_probability must be in [0, 1] and hang_after_calls >= 0, got "
                             f"{self.fail_probability} and {self.hang_after_calls}")
        if not 0 <= self.drain_notice_s < self.drain_timeout_s:
            raise ValueError(f"need 0 <= drain_notice_s < drain_timeout_s, got {self.drain_notice_s} and "
                             f"{self.drain_timeout_s}")
        if self.threads < 1 or self.max_microbatch_size < 1 or self.calibration_batch < 1:
            raise ValueError(f"threads ({self.threads}), max_microbatch_size ({self.max_microbatch_size}) and "
                             f"calibration_batch ({self.calibration_batch}) must be >= 1")


class Peer:
    """A running peer. Use ``async with await Peer.create(config, run=...)`` or call ``shutdown()``."""

    def __init__(self, config: PeerConfig):
        self.config = config
        self.run_id = config.run_id
        self.peer_id = config.peer_id or uuid.uuid4().hex[:16]
        self.state = "starting"
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.endpoint = ""
        self.run: RunConfig | None = None
        self.executor: StageExecutor | None = None
        self.dht = None
        self.directory: RunDirectory | None = None
        self._stack = contextlib.AsyncExitStack()
        self._worker: PriorityWorker | None = None
        self._tasks: list[asyncio.Task] = []
        self.stopped = asyncio.Event()
        self.drain_started: float | None = None
        self.calls_seen = 0
        self._fault_rng = random.Random(config.peer_id)

    @classmethod
    async def create(cls, config: PeerConfig, *, run: RunConfig | None = None,
                     run_wait_s: float = 60.0) -> Peer:
        """Start a peer. ``run`` publishes a new run's config if the DHT has none for ``config.run_id``;
        without it the config is read from the DHT (waiting up to ``run_wait_s``)."""
        self = cls(config)
        try:
            await self._start_dht()
            await self._resolve_run(run, run_wait_s)
            await self._start_executor()
            await self._start_server()
            await self._start_announcer()
        except BaseException:
            await self._stack.aclose()
            raise
        self.state = "serving"
        await self._announce()
        logger.info("peer %s serves stage %d of run '%s' at %s (%.1f samples/s)", self.peer_id,
                    config.stage, self.run_id, self.endpoint, self.throughput)
        return self

    # ------------------------------------------------------------------ startup steps

    async def _start_dht(self) -> None:
        self.dht = await asyncio.to_thread(start_dht, self.config.dht, host=self.config.host,
                                           announce_host=self.config.announce_host)
        self._stack.callback(self.dht.shutdown)
        self.directory = RunDirectory(self.dht, self.run_id)

    async def _resolve_run(self, run: RunConfig | None, wait_s: float) -> None:
        published = await self.directory.get_run()
        if published is None and run is not None:
            await self.directory.publish_run(run, ttl_s=self.config.ttl_s * 12)
            published = run
        elif published is None:
            published = await self.directory.wait_for_run(timeout_s=wait_s)
        elif run is not None and published.fingerprint() != run.fingerprint():
            raise ValueError(f"run '{self.run_id}' already exists in the DHT with another config "
                             f"({published.to_dict()}); drop --preset/model flags to join it, or pick a new --run-id")
        if self.config.stage >= published.model.num_stages:
            raise ValueError(f"run '{self.run_id}' has {published.model.num_stages} stages; "
                             f"--stage {self.config.stage} does not exist")
        self.run = published

    async def _start_executor(self) -> None:
        # One worker thread runs all of this peer's torch work, so compute never races an optimizer step.
        self._worker = PriorityWorker(f"stage{self.config.stage}-compute")
        self._stack.callback(self._worker.shutdown)
        torch.set_num_threads(self.config.threads)
        stage = build_stage(self.run.model, self.config.stage)
        self.executor = StageExecutor(stage, self.run, cache=self.config.cache)
        await self.compute(self.executor.calibrate, self.config.calibration_batch)

    async def _start_server(self) -> None:
        from swarm.peer.service import StageService

        server, port = await start_server(StageService(self), host=self.config.host, port=self.config.port)
        self._server = server
        self._stack.push_async_callback(server.stop, 1.0)
        self.endpoint = f"{self.config.announce_host or self.config.host}:{port}"
        if self.endpoint.startswith("0.0.0.0:"):
            raise ValueError("listening on 0.0.0.0 needs --announce-host: the address trainers should dial")

    async def _start_announcer(self) -> None:
        task = asyncio.create_task(self._announce_loop(), name=f"announce-{self.peer_id}")
        self._tasks.append(task)

        async def stop() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        self._stack.push_async_callback(stop)

    # ------------------------------------------------------------------ running

    @property
    def throughput(self) -> float:
        return self.executor.throughput / self.config.slowdown if self.executor else 0.0

    async def compute(self, fn, *args, **kwargs):
        """Run ``fn`` on the compute thread, after the jobs queued before it (with the configured
        slowdown, for fault injection)."""
        def timed():
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            if self.config.slowdown > 1:
                # Fault injection: hold the worker as a slower device would, so capacity really drops.
                time.sleep((time.perf_counter() - t0) * (self.config.slowdown - 1))
            return result

        return await self._worker.run(timed)

    async def bookkeeping(self, fn, *args):
        """Run a cheap ``fn`` on the compute thread ahead of queued compute (commits, snapshots)."""
        return await self._worker.run(fn, *args, priority=URGENT)

    def submit(self, fn, *args) -> None:
        """Queue a cheap ``fn`` ahead of compute without waiting (cleanup that must not be cancelled)."""
        self._worker.submit(fn, *args, priority=URGENT)

    def record(self) -> StageRecord:
        return StageRecord(peer_id=self.peer_id, endpoint=self.endpoint, stage=self.config.stage,
                           state=self.state, throughput=self.throughput, in_flight=self.in_flight,
                           step=self.executor.step, config_hash=self.run.fingerprint())

    async def _announce(self) -> None:
        await self.directory.announce(self.record(), ttl_s=self.config.ttl_s)

    async def _announce_loop(self) -> None:
        while True:
            try:
                await self._announce()
                # Keep the run's config alive in the DHT for as long as any peer serves it.
                await self.directory.publish_run(self.run, ttl_s=self.config.ttl_s * 12)
            except Exception as e:  # a DHT hiccup must not kill the peer; the next beat retries
                logger.warning("announcement failed: %s", e)
            await asyncio.sleep(self.config.heartbeat_s)

    async def drain(self) -> None:
        """Stop taking new work, finish what is in flight and what trainers will still ask (backward for
        microbatches this peer ran forward), all within ``drain_timeout_s``."""
        if self.state == "draining":
            return
        self.state = "draining"
        self.drain_started = time.monotonic()
        deadline = self.drain_started + self.config.drain_timeout_s
        logger.info("peer %s draining (at most %.0fs)", self.peer_id, self.config.drain_timeout_s)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._announce(), timeout=max(0.1, deadline - time.monotonic()))
        # Trainers stop routing new forwards here once they see the draining state (in a reply or the
        # DHT); until the cached microbatches are claimed by their backward, keep serving.
        while time.monotonic() < deadline - 1.0:
            if not self.accepts_new_work and self.in_flight == 0 and self.executor.cached_microbatches == 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wait_idle_change(), timeout=0.2)

    @property
    def accepts_new_work(self) -> bool:
        """False once draining and past the notice window (trainers have had time to see the state)."""
        if self.drain_started is None:
            return True
        return time.monotonic() - self.drain_started < self.config.drain_notice_s

    async def inject_faults(self) -> None:
        """Fault injection (off by default): fail or hang calls as configured, for tests and benchmarks."""
        self.calls_seen += 1
        cfg = self.config
        if cfg.hang_after_calls and self.calls_seen > cfg.hang_after_calls:
            await asyncio.Event().wait()  # never answers; the caller's deadline ends the call
        if cfg.fail_probability and self._fault_rng.random() < cfg.fail_probability:
            raise TransportError(f"injected fault: peer {self.peer_id} fails this call on purpose "
                                 f"(--fail-probability {cfg.fail_probability})")

    async def _wait_idle_change(self) -> None:
        await self.idle.wait()
        await asyncio.sleep(0.05)  # let a backward that was queued behind the last call arrive

    async def shutdown(self) -> None:
        await self._stack.aclose()
        self.stopped.set()

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def addresses(self) -> list[str]:
        return visible_addresses(self.dht)
