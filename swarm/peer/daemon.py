"""The peer daemon: serves one stage of one run, announces itself in the DHT, drains on SIGTERM.

Built in small steps (``Peer.create``), each registering its own cleanup on an AsyncExitStack, so a peer
that fails half-way through starting still releases what it took, and shutdown needs no guards.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
import uuid
from dataclasses import dataclass, field

import torch
from hivemind.utils import get_dht_time

from swarm.averaging import AveragingConfig, HivemindStageOptimizer
from swarm.balance import RebalanceConfig
from swarm.config import RunConfig
from swarm.discovery.dht import DHTConfig, RunDirectory, start_dht, visible_addresses
from swarm.discovery.records import StageRecord
from swarm.errors import TransportError
from swarm.model import build_stage
from swarm.peer.checkpoint import CheckpointStore
from swarm.peer.executor import CacheConfig, StageExecutor
from swarm.peer.rebalancer import Rebalancer, choose_arrival_stage
from swarm.peer.statesync import fetch_stage_state, serving_peers
from swarm.peer.worker import URGENT, PriorityWorker
from swarm.transport.server import start_server

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    run_id: str = "demo"  # the run to join
    stage: int | None = None  # stage index to serve (default: the stage where this peer adds the most throughput)
    host: str = "127.0.0.1"  # address the gRPC server and the DHT listen on (0.0.0.0 for all interfaces)
    port: int = 0  # gRPC port (0 = any free port)
    announce_host: str | None = None  # address others should dial, if not --host
    peer_id: str | None = None  # stable identity (default: random per start)
    threads: int = 1  # torch intra-op threads for this peer's compute
    heartbeat_s: float = 1.0  # seconds between DHT announcements
    ttl_s: float = 5.0  # announcement lifetime: a silent peer disappears from routing after this
    drain_timeout_s: float = 30.0  # on SIGTERM, exit within this many seconds
    drain_notice_s: float = 3.0  # after SIGTERM, keep accepting forwards this long while trainers learn of it
    drain_idle_s: float = 5.0  # while draining, give up on cached microbatches' backward after this long without any call
    max_microbatch_size: int = 256  # most samples accepted in one request
    calibration_batch: int = 8  # samples used to time the stage at startup
    slowdown: float = 1.0  # fault injection: emulate a device this many times slower (1 = off)
    fail_probability: float = 0.0  # fault injection: answer this share of calls with an error (0 = off)
    hang_after_calls: int = 0  # fault injection: stop answering (hang) after this many calls (0 = off)
    dht: DHTConfig = field(default_factory=DHTConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    checkpoint_dir: str | None = None  # save this peer's stage state here (periodically and on drain); resume from it
    checkpoint_every_steps: int = 10  # optimizer steps between checkpoints (with --checkpoint-dir)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    rebalance: bool = True  # move to the bottleneck stage when the swarm is unbalanced
    balance: RebalanceConfig = field(default_factory=RebalanceConfig)

    def __post_init__(self):
        if self.stage is not None and self.stage < 0:
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
        if not self.drain_idle_s > 0:
            raise ValueError(f"drain_idle_s must be > 0 seconds, got {self.drain_idle_s}")
        if not 0 <= self.drain_notice_s < self.drain_timeout_s:
            raise ValueError(f"need 0 <= drain_notice_s < drain_timeout_s, got {self.drain_notice_s} and "
                             f"{self.drain_timeout_s}")
        if self.checkpoint_every_steps < 1:
            raise ValueError(f"checkpoint_every_steps must be >= 1, got {self.checkpoint_every_steps}")
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
        self.last_call_at = time.monotonic()  # when a call last started or ended (see _drain_work)
        self.endpoint = ""
        self.run: RunConfig | None = None
        self.executor: StageExecutor | None = None
        self.dht = None
        self.directory: RunDirectory | None = None
        self._stack = contextlib.AsyncExitStack()
        self._worker: PriorityWorker | None = None
        self.stopped = asyncio.Event()
        self.stage: int | None = config.stage
        self.moving_to: tuple[int, float] | None = None  # (stage, expected samples/s) during a move
        self.last_moved_s = 0.0
        self.rebalancer: Rebalancer | None = None
        self.drain_started: float | None = None
        self._checkpoints: CheckpointStore | None = None  # set by _start_optimizer with --checkpoint-dir
        self._saved_step = -1  # step of the last checkpoint written or restored
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
            await self._start_optimizer()
            await self._start_server()
            await self._start_announcer()
            await self._start_rebalancer()
        except BaseException:
            await self._stack.aclose()
            raise
        # Arrival counts as a move for the rebalancing cooldown: until this peer and its neighbours have measured
        # real work, its speed is a calibration on a machine that may be busy starting other peers.
        self.state, self.moving_to, self.last_moved_s = "serving", None, get_dht_time()
        await self._announce()
        logger.info("peer %s serves stage %d of run '%s' at %s (%.1f samples/s)", self.peer_id,
                    self.stage, self.run_id, self.endpoint, self.throughput)
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
        if self.stage is not None and self.stage >= published.model.num_stages:
            raise ValueError(f"run '{self.run_id}' has {published.model.num_stages} stages; "
                             f"--stage {self.stage} does not exist")
        self.run = published
        if self.stage is None:
            self.stage = await choose_arrival_stage(self.directory, published.model, self.config.balance,
                                                    random.Random(self.peer_id))
            self.moving_to = (self.stage, 0.0)
            await self._announce()  # "starting" on the chosen stage, so later arrivals count this peer

    async def _start_executor(self) -> None:
        # One worker thread runs all of this peer's torch work, so compute never races an optimizer step.
        self._worker = PriorityWorker(f"peer{self.peer_id[:6]}-compute")
        self._stack.callback(self._worker.shutdown)
        torch.set_num_threads(self.config.threads)
        stage = build_stage(self.run.model, self.stage)
        self.executor = StageExecutor(stage, self.run, cache=self.config.cache, slowdown=self.config.slowdown)
        await self.compute(self.executor.calibrate, self.config.calibration_batch)

    def _background(self, coro, name: str) -> None:
        """Run ``coro`` as a task until shutdown, which cancels it and waits for it to end."""
        task = asyncio.create_task(coro, name=f"{name}-{self.peer_id}")

        async def stop() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        self._stack.push_async_callback(stop)

    async def _start_optimizer(self) -> None:
        """Resume from --checkpoint-dir if this peer has a checkpoint of its stage; attach the stage's hivemind
        optimizer (with --average) and catch up with the stage's peers if they are ahead; then check
        periodically whether the stage's global batch is full, and save a checkpoint every
        ``checkpoint_every_steps`` optimizer steps (and on drain, see :meth:`drain`)."""
        self._checkpoints = CheckpointStore(self.config.checkpoint_dir) if self.config.checkpoint_dir else None
        await self.attach_optimizer(self.executor)
        if self.config.averaging.average:
            async def detach() -> None:  # the optimizer of the stage served at shutdown (a move replaces it)
                await asyncio.to_thread(self.executor.optimizer.shutdown)

            self._stack.push_async_callback(detach)
        self._background(self._step_loop(), "steps")

    async def attach_optimizer(self, executor: StageExecutor) -> None:
        """Restore the stage's checkpoint if this peer has one; with --average, give ``executor`` its stage's
        hivemind optimizer and download the state from the stage's peers if they are further along."""
        stage = executor.stage.index

        if self.config.averaging.average:  # on the event loop's thread, which owns signal handling
            executor.optimizer = HivemindStageOptimizer(executor.stage, self.run, dht=self.dht, run_id=self.run_id,
                                                        config=self.config.averaging)

        # The stage's averaging peers announce their step: a newcomer must reach it before it serves.
        peers_step = 0
        if self.config.averaging.average:
            ahead = await serving_peers(self.directory, stage, exclude=self.peer_id)
            peers_step = ahead[0].step if ahead else 0

        def build() -> None:
            restored = self._checkpoints.load(stage, run=self.run) if self._checkpoints else None
            if restored is not None:
                executor.load_state(restored)
                logger.info("stage %d resumed from checkpoint at step %d", stage, executor.step)
            if self.config.averaging.average and executor.optimizer.sync_with_peers(peers_step):
                logger.info("stage %d state downloaded from its peers: now at step %d", stage, executor.step)

        await self.compute(build)
        self._saved_step = executor.step

    async def _step_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.averaging.step_check_s)
            try:
                if self.config.averaging.average:
                    await self.bookkeeping(self.executor.maybe_step)
                if self.executor.step >= self._saved_step + self.config.checkpoint_every_steps:
                    await self.save_checkpoint()
            except OSError as e:  # a full disk must not stop serving; say so and retry later
                logger.error("could not write the checkpoint: %s", e)
            except Exception as e:  # averaging trouble must not kill the peer; the next check retries
                logger.warning("optimizer step check failed: %s", e)

    async def save_checkpoint(self) -> None:
        """Write this peer's stage state to --checkpoint-dir (no-op without it)."""
        if self._checkpoints is None:
            return
        state = await self.bookkeeping(self.executor.state_dict)
        await asyncio.to_thread(self._checkpoints.save, state, run=self.run)
        self._saved_step = state["step"]
        logger.info("checkpoint of stage %d at step %d written to %s", state["stage"], state["step"],
                    self._checkpoints.directory)

    async def _start_server(self) -> None:
        from swarm.peer.service import StageService

        server, port = await start_server(StageService(self), host=self.config.host, port=self.config.port)
        self._server = server
        self._stack.push_async_callback(server.stop, 1.0)
        self.endpoint = f"{self.config.announce_host or self.config.host}:{port}"
        if self.endpoint.startswith("0.0.0.0:"):
            raise ValueError("listening on 0.0.0.0 needs --announce-host: the address trainers should dial")

    async def _start_rebalancer(self) -> None:
        if not self.config.rebalance or self.run.model.num_stages < 2:
            return
        self.rebalancer = Rebalancer(self, self.config.balance)
        self._background(self.rebalancer.run(), "rebalance")

    async def _start_announcer(self) -> None:
        self._background(self._announce_loop(), "announce")

    # ------------------------------------------------------------------ running

    @property
    def throughput(self) -> float:
        return self.executor.throughput if self.executor else 0.0

    async def compute(self, fn, *args, **kwargs):
        """Run ``fn`` on the compute thread, after the jobs queued before it."""
        return await self._worker.run(functools.partial(fn, *args, **kwargs))

    async def bookkeeping(self, fn, *args):
        """Run a cheap ``fn`` on the compute thread ahead of queued compute (commits, snapshots)."""
        return await self._worker.run(fn, *args, priority=URGENT)

    def submit(self, fn, *args) -> None:
        """Queue a cheap ``fn`` ahead of compute without waiting (cleanup that must not be cancelled)."""
        self._worker.submit(fn, *args, priority=URGENT)

    def records(self) -> list[StageRecord]:
        """What this peer announces: its stage, and during a move a "starting" record on the target."""
        out = [] if self.executor is None else [self.record()]
        if self.moving_to is not None:
            target, expected = self.moving_to
            out.append(StageRecord(peer_id=self.peer_id, endpoint=self.endpoint, stage=target, state="starting",
                                   throughput=expected, in_flight=0, step=0, config_hash=self.run.fingerprint(),
                                   last_moved_s=self.last_moved_s))
        return out

    def record(self) -> StageRecord:
        return StageRecord(peer_id=self.peer_id, endpoint=self.endpoint, stage=self.stage,
                           state=self.state, throughput=self.throughput, in_flight=self.in_flight,
                           step=self.executor.step, config_hash=self.run.fingerprint(),
                           last_moved_s=self.last_moved_s, step_pause_s=self.executor.optimizer.step_pause_s)

    async def _announce(self) -> None:
        for record in self.records():
            await self.directory.announce(record, ttl_s=self.config.ttl_s)

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
        self.moving_to = None  # leaving the swarm, not moving within it
        await self._drain_work()
        await self.save_checkpoint()

    async def move_to(self, stage: int, *, expected_throughput: float) -> None:
        """Leave the current stage for ``stage``: drain, load the new stage's state from its peers, serve."""
        old = self.stage
        self.moving_to = (stage, expected_throughput)
        await self._drain_work()
        stage_module = build_stage(self.run.model, stage)
        # With --average the stage's hivemind optimizer downloads parameters and optimizer state below;
        # without it, the parameters of the stage's most advanced peer.
        state = await fetch_stage_state(self.directory, stage, exclude=self.peer_id, timeout_s=60)
        if state is not None:
            stage_module.load_state_dict(state)
        executor = StageExecutor(stage_module, self.run, cache=self.config.cache,
                                 slowdown=self.config.slowdown)
        await self.compute(executor.calibrate, self.config.calibration_batch)
        if self.config.averaging.average:
            await asyncio.to_thread(self.executor.optimizer.shutdown)
        await self.attach_optimizer(executor)
        self.executor, self.stage = executor, stage
        self.last_moved_s = get_dht_time()
        self.moving_to, self.drain_started, self.state = None, None, "serving"
        await self._announce()
        logger.info("peer %s moved from stage %d to stage %d (%s)", self.peer_id, old, stage,
                    "state loaded from its peers" if state is not None else "no peer to load from: fresh init")

    async def _drain_work(self) -> None:
        self.state = "draining"
        self.drain_started = time.monotonic()
        deadline = self.drain_started + self.config.drain_timeout_s
        logger.info("peer %s draining (at most %.0fs)", self.peer_id, self.config.drain_timeout_s)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._announce(), timeout=max(0.1, deadline - time.monotonic()))
        # Trainers stop routing new forwards here once they see the draining state (in a reply or the
        # DHT); until the cached microbatches are claimed by their backward, keep serving.
        while time.monotonic() < deadline - 1.0:
            if not self.accepts_new_work and self.in_flight == 0:
                cached = self.executor.cached_microbatches
                if cached == 0:
                    break
                quiet_s = time.monotonic() - self.last_call_at
                if quiet_s >= self.config.drain_idle_s:
                    # No call for a while: whoever ran these forwards is gone and will not send their backward.
                    logger.info("peer %s drops %d cached microbatches: no call for %.1fs", self.peer_id, cached,
                                quiet_s)
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
