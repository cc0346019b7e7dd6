"""A peer's life: start, serve one stage of one run, move to another stage, drain on SIGTERM, stop.

Built in small steps (``Peer.create``), each registering its own cleanup on an AsyncExitStack, so a peer
that fails half-way through starting still releases what it took, and shutdown needs no guards. The parts
it wires together talk through narrow interfaces: the service and the announcer read the peer through
getters, admission owns the call counts, and the rebalancer moves the peer through a callback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from swarm.averaging import HivemindStageOptimizer
from swarm.averaging.direct import DirectAllReduce
from swarm.averaging.optimizer import CHECK_SOON_S
from swarm.config import RunConfig
from swarm.deadline import timeout
from swarm.discovery.dht import RunDirectory, start_dht, visible_addresses
from swarm.discovery.watch import EXIT_DHT_LOST, DHTLost, DHTWatch
from swarm.identity import Identity
from swarm.model import build_stage, state_digest
from swarm.model.device import Compute
from swarm.optim import LocalStageOptimizer
from swarm.peer.admission import Admission
from swarm.peer.announcer import RUN_TTL_FACTOR, Announcer, Serving
from swarm.peer.checkpoint import CheckpointStore
from swarm.peer.config import PeerConfig
from swarm.peer.executor import StageExecutor
from swarm.peer.lies import install_lies
from swarm.peer.members import apply_caller_list, follow_caller_list, load_allow_callers
from swarm.peer.memory import (
    check_fits,
    device_total_bytes,
    estimate_stage_memory,
    gib,
    resolve_graph_cache,
)
from swarm.peer.metrics import PeerMetrics
from swarm.peer.push import PushHops
from swarm.peer.reachability import Verdict, advice, check_reachability
from swarm.peer.rebalancer import (
    Rebalancer,
    choose_arrival_stage,
    neediest_other_stage,
    stage_costs,
)
from swarm.peer.relaying import Relaying, relay_summary, start_relay_server
from swarm.peer.routecheck import RouteCheck
from swarm.peer.service import ServiceContext, StageService
from swarm.peer.statesync import fetch_stage_state, serving_peers
from swarm.peer.stepwatch import StepWatch
from swarm.peer.worker import PriorityWorker
from swarm.states import PeerState, Reachability
from swarm.transport.callers import CallerCheck, caller_token
from swarm.transport.client import ClientPool
from swarm.transport.relay import RelayServer
from swarm.transport.security import PeerAddress, make_certificate, server_credentials
from swarm.transport.server import start_server

logger = logging.getLogger(__name__)

# Seconds a peer moving in waits for a stage's parameters from one of its peers.
FETCH_STATE_TIMEOUT_S = 60.0
# A DHT node that answered none of a peer's heartbeats for this long is lost (see DHTWatch); so is one whose process
# exited. The peer then cannot be found nor find its stage: it leaves (see Peer.dht_lost).
DHT_SILENT_S = 60.0
# What a peer that lost its DHT node allows its shutdown: parts of it may wait on the node (hivemind's optimizer
# reports its progress on the way out) and would wait forever.
SHUTDOWN_WITHOUT_DHT_S = 30.0


class Peer:
    """A running peer. Use ``async with await Peer.create(config, run=...)`` or call ``shutdown()``."""

    def __init__(self, config: PeerConfig):
        self.config = config
        self.run_id = config.run_id
        # its key: the peer id derives from it, and it signs every record the peer writes in the DHT
        self.identity = Identity.load_or_create(config.dht.identity_path)
        self.peer_id = self.identity.peer_id
        self.state = PeerState.STARTING
        # (when, samples applied, busy seconds) of the executor at the last summary (--log-every-s); set anew
        # with each executor (its counts start at zero)
        self._summary_mark = (time.monotonic(), 0, 0.0)
        self.stage_index: int | None = config.stage  # the stage served (or chosen on arrival)
        self.endpoint = ""
        # the certificate its server presents, announced in its record ("" = --plaintext)
        self.tls_cert = ""
        # whether callers can dial its endpoint, as a peer of the run found at its start (announced)
        self.reachability = Reachability.DIRECT
        self.reachability_verdict: Verdict | None = (
            None  # what the check at start found (None: not run)
        )
        self.caller_check: CallerCheck | None = None  # admits its callers (set with the server)
        # relaying (swarm.peer.relaying): for others, when it is reachable; through one, when it is not
        self.relay_server: RelayServer | None = None
        self.relaying: Relaying | None = None
        self.relay_peer_id = ""  # the relay whose endpoint it announces ("" = none)
        self.run: RunConfig | None = None
        self.executor: StageExecutor | None = None  # replaced by a move
        self.compute: Compute | None = None  # device and dtype (set with the compute thread)
        self.memory_bytes = 0  # the estimate for the stage served (see swarm.peer.memory)
        self._device_memory_bytes = 0  # all the memory of its device (0 = not known)
        self.dht = None
        self._dht_addresses: list[str] = []
        self.directory: RunDirectory | None = None
        # set once its DHT node is lost (its process exited, or it stopped answering): see _on_dht_lost
        self.dht_lost = asyncio.Event()
        self._dht_watch: DHTWatch | None = None
        self._creating: asyncio.Task | None = (
            None  # create()'s task while it runs (a lost node cancels it)
        )
        # calls the next stage of push calls (set once it serves)
        self.push_hops: PushHops | None = None
        self._reduce_clients: ClientPool | None = None  # see _direct_clients
        self.rebalancer: Rebalancer | None = None
        self.metrics: PeerMetrics | None = None  # with --metrics-port
        self.metrics_port: int | None = None  # the port they are served on
        self.stopped = asyncio.Event()
        self.admission = Admission(
            peer_id=self.peer_id,
            drain_timeout_s=config.drain_timeout_s,
            drain_notice_s=config.drain_notice_s,
            drain_idle_s=config.drain_idle_s,
            fail_probability=config.fail_probability,
            hang_after_calls=config.hang_after_calls,
            lose_commit_probability=config.lose_commit_probability,
            rng=random.Random(self.peer_id),
        )
        self._announcer: Announcer | None = None
        self._worker: PriorityWorker | None = None
        self._checkpoints = (
            CheckpointStore(config.checkpoint_dir) if config.checkpoint_dir else None
        )
        self._saved_step = -1  # step of the last checkpoint written or restored
        # During a move, from the hand-in of its samples to serving the new stage: the old stage's optimizer is shut
        # down, so the step loop leaves it alone and the heartbeat announces no record of the old stage.
        self._between_stages = False
        # an operator's move (SIGUSR1), see request_move
        self._requested_move: asyncio.Task | None = None
        # wakes the step check before its period (see _wake_step_loop); the loop is set when the check starts
        self._step_wake = asyncio.Event()
        self._step_wake_loop: asyncio.AbstractEventLoop | None = None
        # closes of a batch waiting for this replica's step on it (told after each step check)
        self.steps = StepWatch(lambda: self.executor.step)
        # wakes the loop that hashes the parameters after they changed (see _digest_loop)
        self._digest_wake = asyncio.Event()
        self._stack = contextlib.AsyncExitStack()

    @classmethod
    async def create(
        cls, config: PeerConfig, *, run: RunConfig | None = None, run_wait_s: float = 60.0
    ) -> Peer:
        """Start a peer. ``run`` publishes a new run's config if the DHT has none for ``config.run_id``;
        without it the config is read from the DHT (waiting up to ``run_wait_s``)."""
        self = cls(config)
        self._creating = asyncio.current_task()
        try:
            await self._start_dht()
            await self._resolve_run(run, run_wait_s)
            await self._start_announcer()
            await self._choose_stage()
            await self._start_compute()
            await self._start_replica()
            await self._start_step_loop()
            await self._start_server()
            await self._check_reachability()
            await self._start_relaying()
            await self._start_heartbeat()
            await self._start_rebalancer()
        except BaseException as e:
            await self.shutdown()
            if isinstance(e, asyncio.CancelledError) and self.dht_lost.is_set():
                raise DHTLost(
                    f"peer {self.peer_id} could not start: {self._dht_watch.lost}; start `swarm peer` "
                    "again (check the log above for why the node ended)"
                ) from None
            raise
        finally:
            self._creating = None
        # Arrival counts as a move for the rebalancing cooldown: until this peer and its neighbours have measured
        # real work, its speed is a calibration on a machine that may be busy starting other peers.
        self.state = PeerState.SERVING
        self._announcer.settled()
        await self._announcer.announce()
        logger.info(
            "peer %s serves stage %d of run '%s' at %s (%.1f samples/s)",
            self.peer_id,
            self.stage_index,
            self.run_id,
            self.endpoint,
            self.throughput,
        )
        return self

    # ------------------------------------------------------------------ startup steps

    async def _start_dht(self) -> None:
        self.dht = await asyncio.to_thread(
            start_dht,
            self.config.dht,
            host=self.config.host,
            announce_host=self.config.announce_host,
            identity=self.identity,
        )
        self._stack.callback(self.dht.shutdown)
        # asked once, now: the call blocks its caller until the node answers (forever if it died)
        self._dht_addresses = await asyncio.to_thread(visible_addresses, self.dht)
        self._dht_watch = DHTWatch(self.dht, silent_s=DHT_SILENT_S, on_lost=self._on_dht_lost)
        self._dht_watch.start()
        self._stack.callback(self._dht_watch.stop)  # before the node's shutdown ends its process
        self.directory = RunDirectory(self.dht, self.run_id, run_owner=self.config.dht.run_owner)

    def _on_dht_lost(self, reason: str) -> None:
        logger.error(
            "peer %s lost its DHT node: %s. Trainers cannot find this peer any more, nor can it find its stage: "
            "it stops (`swarm peer` drains what is in flight and exits with code %d; a supervisor restarts it, "
            "as docker compose's restart: on-failure does)",
            self.peer_id,
            reason,
            EXIT_DHT_LOST,
        )
        self.dht_lost.set()
        if self._creating is not None:
            self._creating.cancel()

    async def _resolve_run(self, run: RunConfig | None, wait_s: float) -> None:
        published = await self.directory.get_run()
        if published is None and run is not None:
            await self.directory.publish_run(run, ttl_s=self.config.ttl_s * RUN_TTL_FACTOR)
            published = run
        elif published is None:
            published = await self.directory.wait_for_run(timeout_s=wait_s)
        elif run is not None and _joins_from_checkpoint(published, run, self.config.pretrained):
            logger.info(
                "run '%s' exists and started from the checkpoint in --pretrained: joining it with its config",
                self.run_id,
            )
        elif run is not None and published.fingerprint() != run.fingerprint():
            raise ValueError(
                f"run '{self.run_id}' already exists in the DHT with another config "
                f"({published.to_dict()}); drop --preset/model flags to join it, or pick a new --run-id"
            )
        if self.stage_index is not None and self.stage_index >= published.model.num_stages:
            raise ValueError(
                f"run '{self.run_id}' has {published.model.num_stages} stages; "
                f"--stage {self.stage_index} does not exist"
            )
        self.run = published
        logger.info(
            "run '%s' compresses activations: %s", self.run_id, published.compression_scheme()
        )

    async def _start_announcer(self) -> None:
        self._announcer = Announcer(
            self.directory,
            self.run,
            peer_id=self.peer_id,
            ttl_s=self.config.ttl_s,
            heartbeat_s=self.config.heartbeat_s,
            watch=self._dht_watch,
            endpoint=lambda: self.endpoint,
            serving=self._serving,
            tls_cert=lambda: self.tls_cert,
            reachability=lambda: self.reachability,
            relaying=lambda: (
                self.relay_peer_id,
                self.relay_server.port if self.relay_server is not None else 0,
            ),
        )

    async def _choose_stage(self) -> None:
        if self.stage_index is not None:
            return
        self.stage_index = await choose_arrival_stage(
            self.directory, self.run.model, self.config.balance, random.Random(self.peer_id)
        )
        self._announcer.heading_to(self.stage_index)
        # "starting" on the chosen stage, so later arrivals count this peer
        await self._announcer.announce()

    async def _start_compute(self) -> None:
        # One worker thread runs all of this peer's torch work, so compute never races an optimizer step.
        self._worker = PriorityWorker(f"peer{self.peer_id[:6]}-compute")
        self._stack.callback(self._worker.shutdown)
        torch.set_num_threads(self.config.threads)
        self.compute = Compute.from_flags(self.config.device, self.config.dtype)
        self._device_memory_bytes = device_total_bytes(self.compute.device)
        logger.info(
            "peer %s computes on %s in %s",
            self.peer_id,
            self.compute.device,
            self.compute.dtype_name,
        )

    async def _start_replica(self) -> None:
        """Build this peer's replica of its stage (resumed from --checkpoint-dir, caught up with the stage's
        peers with --average), and stop its optimizer at shutdown."""
        self.executor, _ = await self._build_executor(self.stage_index, moving=False)
        self._saved_step = self.executor.step
        self._summary_mark = (time.monotonic(), 0, self.executor.busy_s)  # after the calibration

        # the optimizer of the stage served at shutdown (a move replaces it; between stages, none is left to stop),
        # on the compute thread: a step check the cancelled step loop left running there must end first (hivemind's
        # shutdown raced it: "Set changed size during iteration")
        async def detach() -> None:
            if not self._between_stages:
                await self._worker.compute_urgent(self.executor.optimizer.shutdown)

        self._stack.push_async_callback(detach)

    async def _build_executor(self, stage_index: int, *, moving: bool) -> tuple[StageExecutor, str]:
        """A calibrated replica of ``stage_index`` and where its state came from. Its checkpoint, if this
        peer has one, is restored first; then its peers' state is downloaded once: with --average by the
        stage's hivemind optimizer if they are ahead, without it (on a move only, and only with no
        checkpoint) the parameters of the stage's most advanced peer."""
        run, config = self.run, self.config
        cache = resolve_graph_cache(
            config.cache,
            run.model,
            stage_index,
            self.compute.device,
            compute_dtype=self.compute.dtype,
            averaging=config.averaging.average,
            limit_bytes=config.memory_limit_bytes,
        )
        memory = estimate_stage_memory(
            run.model,
            stage_index,
            cache,
            compute_dtype=self.compute.dtype,
            averaging=config.averaging.average,
        )
        if moving:  # the stage it leaves still holds its memory: only say so
            if config.memory_limit_bytes is not None and memory.total > config.memory_limit_bytes:
                logger.warning(
                    "stage %d needs about %s, over --memory-limit-bytes %s",
                    stage_index,
                    memory.describe(),
                    gib(config.memory_limit_bytes),
                )
        else:
            check_fits(memory, stage_index, self.compute.device, config.memory_limit_bytes)
        self.memory_bytes = memory.total
        stage_module = build_stage(
            run.model, stage_index, device=self.compute.device, pretrained=config.pretrained
        )
        restored = None
        if self._checkpoints is not None:
            restored = await asyncio.to_thread(self._checkpoints.load, stage_index, run=run)
        source = (
            "resumed from its checkpoint"
            if restored is not None
            else "no peer to load from: fresh init"
        )
        if moving and not config.averaging.average and restored is None:
            state = await fetch_stage_state(
                self.directory, stage_index, exclude=self.peer_id, timeout_s=FETCH_STATE_TIMEOUT_S
            )
            if state is not None:
                stage_module.load_state_dict(state)
                source = "state loaded from its peers"
        peers_step = 0
        if config.averaging.average:
            # The stage's averaging peers announce their step: a newcomer must reach it before it serves.
            ahead = await serving_peers(self.directory, stage_index, exclude=self.peer_id)
            peers_step = ahead[0].step if ahead else 0
            # Built on the event loop's thread, which owns signal handling.
            optimizer = HivemindStageOptimizer(
                stage_module,
                run,
                dht=self.dht,
                run_id=self.run_id,
                config=config.averaging,
                # its progress records are signed by the key this node's DHT validator holds (it keeps one)
                private_key=self.identity.private_key,
            )
            optimizer.wake = self._wake_step_loop
            optimizer.endpoint_in_doubt = self._endpoint_in_doubt
            if config.averaging.all_reduce == "direct":
                optimizer.direct = DirectAllReduce(
                    peer_id=self.peer_id,
                    run_id=self.run_id,
                    stage=stage_index,
                    clients=self._direct_clients(),
                    loop=asyncio.get_running_loop(),
                    timeout_s=config.averaging.chunk_timeout_s,
                    current_step=lambda: optimizer.step,
                    numel=sum(p.numel() for p in stage_module.parameters()),
                )
        else:
            optimizer = LocalStageOptimizer(stage_module, run)
        executor = StageExecutor(
            stage_module,
            run,
            optimizer=optimizer,
            cache=cache,
            slowdown=config.slowdown,
            compute=self.compute,
        )
        install_lies(
            executor,
            output_scale=config.lie_output_scale,
            gradient_scale=config.lie_gradient_scale,
        )

        def restore_then_sync() -> bool:
            if restored is not None:
                executor.load_state(restored)
                logger.info(
                    "stage %d resumed from checkpoint at step %d", stage_index, executor.step
                )
            synced = config.averaging.average and optimizer.sync_with_peers(peers_step)
            if synced:
                executor.parameters_changed()
                logger.info(
                    "stage %d state downloaded from its peers: now at step %d",
                    stage_index,
                    executor.step,
                )
            executor.param_digest()  # announced from the first heartbeat on
            return synced

        try:
            await self._worker.compute(executor.calibrate, config.calibration_batch)
            if await self._worker.compute(restore_then_sync):
                source = "state loaded from its peers"
        except BaseException:  # the hivemind optimizer runs processes of its own: stop them
            await asyncio.to_thread(optimizer.shutdown)
            raise
        return executor, source

    def _background(self, coro, name: str) -> None:
        """Run ``coro`` as a task until shutdown, which cancels it and waits for it to end."""
        task = asyncio.create_task(coro, name=f"{name}-{self.peer_id}")

        async def stop() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        self._stack.push_async_callback(stop)

    async def _start_step_loop(self) -> None:
        """Check periodically whether the stage's global batch is full (with --average), rehash the parameters
        if they changed (the digest the heartbeat announces), and save a checkpoint every
        ``checkpoint_every_steps`` optimizer steps (and on drain, see :meth:`drain`). The optimizer wakes the
        check at once when a batch is closed or its all-reduce is done (:meth:`_wake_step_loop`)."""
        self._step_wake_loop = asyncio.get_running_loop()
        self._background(self._step_loop(), "steps")
        # the digest loop's thread: shut down (waiting for a hash under way) after the loop's task is cancelled,
        # while the event loop the hash answers to still runs
        hasher = ThreadPoolExecutor(1, thread_name_prefix=f"peer{self.peer_id[:6]}-digest")
        self._stack.callback(hasher.shutdown)
        self._background(self._digest_loop(hasher), "digest")

    def _wake_step_loop(self) -> None:
        """Run the next step check now rather than at its period (any thread): in lockstep training every batch
        waits for the step, and two waits of up to ``step_check_s`` each (close to group, all-reduce to update) were
        a few percent of each step on loopback."""
        loop = self._step_wake_loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the peer is gone
                loop.call_soon_threadsafe(self._step_wake.set)

    async def _step_loop(self) -> None:
        while True:
            period = self.config.averaging.step_check_s
            if self.executor.optimizer.check_soon:
                period = min(period, CHECK_SOON_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._step_wake.wait(), period)
            self._step_wake.clear()
            if self._between_stages:
                continue
            try:
                if self.config.averaging.average:
                    await self._worker.compute_urgent(self.executor.maybe_step)
                    self.steps.changed()
                # rehash if the parameters changed since the last hash (in the digest loop: the heartbeat never
                # hashes, and neither does the compute thread); known, it costs no trip to the compute thread
                if not self.executor.step_and_digest()[1]:
                    self._digest_wake.set()
                if self.executor.step >= self._saved_step + self.config.checkpoint_every_steps:
                    await self.save_checkpoint()
            except OSError as e:  # a full disk must not stop serving; say so and retry later
                logger.error("could not write the checkpoint: %s", e)
            # averaging trouble must not kill the peer; the next check retries
            except Exception as e:
                logger.warning("optimizer step check failed: %s", e)

    async def _digest_loop(self, hasher: ThreadPoolExecutor) -> None:
        """Hash the parameters whenever the step check finds them changed, for the digest the heartbeat
        announces. The compute thread only takes the snapshot (the current version's copies, nothing copied); the
        host copy and the hash run in another thread while the compute thread goes on serving."""
        while True:
            await self._digest_wake.wait()
            self._digest_wake.clear()
            executor = self.executor  # a move replaces it: the hash is recorded where it was taken
            try:
                work = await self._worker.compute_urgent(executor.digest_snapshot)
                if work is not None:
                    digest = await asyncio.get_running_loop().run_in_executor(
                        hasher, state_digest, work.state
                    )
                    await self._worker.compute_urgent(executor.record_digest, work, digest)
            except Exception as e:  # never kills the peer: the next step check wakes it again
                logger.warning(
                    "hashing the parameters failed (retried at the next step check; until then this peer "
                    "announces no digest): %s",
                    e,
                )

    async def save_checkpoint(self) -> None:
        """Write this peer's stage state to --checkpoint-dir (no-op without it)."""
        if self._checkpoints is None:
            return
        state = await self._worker.compute_urgent(self.executor.state_dict)
        await asyncio.to_thread(self._checkpoints.save, state, run=self.run)
        self._saved_step = state["step"]
        logger.info(
            "checkpoint of stage %d at step %d written to %s",
            state["stage"],
            state["step"],
            self._checkpoints.directory,
        )

    async def _start_server(self) -> None:
        context = ServiceContext(
            run_id=self.run_id,
            peer_id=self.peer_id,
            state=lambda: self.state,
            executor=lambda: self.executor,
            admission=self.admission,
            max_microbatch_size=self.config.max_microbatch_size,
            compute=self._worker.compute,
            compute_urgent=self._worker.compute_urgent,
            submit_urgent=self._worker.submit_urgent,
            limits=self.config.limits,
            push=await self._push_hops(),
            steps=self.steps if self.config.averaging.average else None,
        )
        service = StageService(context)
        if self.config.metrics_port is not None:
            self.metrics = PeerMetrics(
                self, late_commits=lambda: service.late_commits, queue=service.queue
            )
            service.observer = self.metrics.observe_call
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
            self._stack.callback(self.metrics.close)
            logger.info(
                "peer %s serves Prometheus metrics at http://%s:%d/metrics",
                self.peer_id,
                self.config.host,
                self.metrics_port,
            )
        credentials = None
        if not self.config.plaintext:
            self.tls_cert = make_certificate(self.identity)
            credentials = server_credentials(self.identity, self.tls_cert)
        self.caller_check = CallerCheck(
            self.peer_id, allowed=load_allow_callers(self.config.allow_callers)
        )
        await apply_caller_list(self.directory, self.caller_check)  # in force from the first call
        server, port = await start_server(
            service,
            host=self.config.host,
            port=self.config.port,
            credentials=credentials,
            interceptors=[self.caller_check],
            window_bytes=self.config.limits.stream_window_bytes,
            max_calls=self.config.limits.max_open_calls,
        )
        self._stack.push_async_callback(server.stop, 1.0)
        self.endpoint = f"{self.config.announce_host or self.config.host}:{port}"
        if self.endpoint.startswith("0.0.0.0:"):
            raise ValueError(
                "listening on 0.0.0.0 needs --announce-host: the address trainers should dial"
            )

    async def _check_reachability(self) -> None:
        """Ask a peer of the run to dial this one back (--no-reachability-check: announced direct, unchecked)."""
        if not self.config.reachability_check:
            return
        verdict = await check_reachability(
            self.directory,
            num_stages=self.run.model.num_stages,
            address=self.address,
            token=caller_token(self.identity),
            timeout_s=self.config.limits.dial_back_timeout_s,
            rng=random.Random(self.peer_id),
        )
        self.reachability, self.reachability_verdict = verdict.reachability, verdict
        line = advice(verdict, self.endpoint)
        if verdict.reachability == Reachability.DIRECT:
            logger.info("%s", line)
        else:
            logger.warning("%s", line)

    async def _start_relaying(self) -> None:
        """Relay for the run's peers behind NAT (a reachable peer, unless --no-relay-for-others), or serve through
        one (a peer found unreachable): its first relay is waited for here, at most the relay timeout, so it
        announces an endpoint callers can use as it starts serving."""
        relay = self.config.relay
        if self.reachability == Reachability.DIRECT:
            if relay.relay_for_others:
                self.relay_server = await start_relay_server(
                    relay, self.caller_check, bind_host=self.config.host, endpoint=self.endpoint
                )
                self._stack.push_async_callback(self.relay_server.close)
            return
        own_endpoint = self.endpoint

        async def on_change(endpoint: str, relay_peer_id: str) -> None:
            self.endpoint, self.relay_peer_id = endpoint or own_endpoint, relay_peer_id
            if not endpoint:
                await self._relay_lost()
            if self.state != PeerState.STARTING:
                try:  # at once: callers must not wait a heartbeat for the new endpoint
                    await self._announcer.announce()
                except Exception as e:  # a DHT hiccup: the next heartbeat announces it
                    logger.warning("announcing the relayed endpoint failed: %s", e)

        self.relaying = Relaying(
            self.directory,
            num_stages=self.run.model.num_stages,
            peer_id=self.peer_id,
            token=caller_token(self.identity),
            local_endpoint=own_endpoint,
            on_change=on_change,
            rng=random.Random(self.peer_id),
        )
        self._background(self.relaying.run_forever(), "relaying")
        with contextlib.suppress(TimeoutError):
            async with timeout(3 * relay.relay_open_timeout_s):
                await self.relaying.has_relay.wait()

    def _endpoint_in_doubt(self) -> bool:
        """Whether the endpoint callers reach this peer at may be gone without its having seen to it yet: relayed,
        and its relay not heard for a while, or the relay's loss not yet handled (``_relay_lost``: until then a
        step check would step on samples a trainer may have computed again elsewhere). Any thread."""
        if self.relaying is None:
            return False
        link = self.relaying.link
        return self.relaying.lost_unsaid() or (link is not None and link.in_doubt())

    async def _relay_lost(self) -> None:
        """The relay closed the port this replica was reached at (it died, or this replica was silent past its
        keepalives: frozen, say). A trainer closing a batch meanwhile found the port refusing and computed this
        replica's samples of unstepped batches again elsewhere: leave them out here, or they would count twice."""
        executor = self.executor
        if executor is None or not isinstance(executor.optimizer, HivemindStageOptimizer):
            return
        try:
            await self._worker.compute_urgent(
                executor.optimizer.leave_out_held, "its relay closed the port it was reached at"
            )
        except Exception as e:  # never kills the relaying loop: the samples then stay in
            logger.warning("leaving out the samples held after losing the relay failed: %s", e)

    def _direct_clients(self) -> ClientPool:
        """The clients this peer calls its stage's replicas with in direct all-reduces (one pool for the peer's
        life, whatever stage it serves), signed with its own identity."""
        if self._reduce_clients is None:
            self._reduce_clients = ClientPool(token=caller_token(self.identity))
            self._stack.push_async_callback(self._reduce_clients.close)
        return self._reduce_clients

    async def _push_hops(self) -> PushHops:
        """The client this peer calls the next stage of push calls with, signed with its own identity."""
        hops = PushHops(
            ClientPool(token=caller_token(self.identity)),
            self.run_id,
            activation_codec=self.run.codec,
            route_check=RouteCheck(
                self.directory.stage_records, config_hash=self.run.fingerprint()
            ),
        )
        self._stack.push_async_callback(hops.close)
        self.push_hops = hops
        return hops

    async def _start_heartbeat(self) -> None:
        self._background(self._announcer.run_forever(), "announce")
        self._background(follow_caller_list(self.directory, self.caller_check), "callers")
        if self.config.log_every_s > 0:
            self._background(self._log_forever(), "summary")

    def summary(self) -> str:
        """A line saying what the peer did since the last summary (or since it began serving its stage)."""
        ex, now = self.executor, time.monotonic()
        since, self._summary_mark = self._summary_mark, (now, ex.samples_applied, ex.busy_s)
        elapsed = max(now - since[0], 1e-9)
        samples, busy = ex.samples_applied - since[1], ex.busy_s - since[2]
        return (
            f"peer {self.peer_id} stage {self.stage_index} {self.state.value}: step {ex.step}, "
            f"{samples / elapsed:.1f} samples/s applied over {elapsed:.0f}s ({ex.microbatches_applied} "
            f"microbatches in all), busy {100 * min(busy / elapsed, 1.0):.0f}%, in flight "
            f"{self.admission.in_flight}, held gradients {ex.held_gradients}, dropped {ex.gradients_dropped}, "
            f"backwards from a kept graph {ex.backwards_from_graph} / recomputed {ex.backwards_recomputed}"
            f"{_left_out(ex.samples_left_out)}"
            f"{relay_summary(self.relay_server, self.relaying)}"
        )

    async def _log_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.log_every_s)  # the summary period
            if self.executor is not None:
                logger.info("%s", self.summary())

    async def _start_rebalancer(self) -> None:
        self._stack.push_async_callback(self._stop_requested_move)
        if not self.config.rebalance or self.run.model.num_stages < 2:
            return
        self.rebalancer = Rebalancer(
            self.directory,
            self.run.model,
            self.config.balance,
            peer_id=self.peer_id,
            state=lambda: self.state,
            move=lambda stage_index, expected: self.move_to(
                stage_index, expected_throughput=expected
            ),
        )
        self._background(self.rebalancer.run(), "rebalance")

    # ------------------------------------------------------------------ running

    @property
    def address(self) -> PeerAddress:
        """How callers reach this peer: what its record announces (endpoint, id, certificate)."""
        return PeerAddress(self.endpoint, self.peer_id, self.tls_cert)

    @property
    def throughput(self) -> float:
        return self.executor.throughput if self.executor else 0.0

    def _serving(self) -> Serving | None:
        """What the heartbeat announces for the stage this peer serves (None before it serves one)."""
        ex = self.executor
        if ex is None or self._between_stages:
            return None
        # after a step and until the step loop rehashes, no digest
        step, digest = ex.step_and_digest()
        return Serving(
            stage_index=self.stage_index,
            state=self.state,
            throughput=ex.throughput,
            in_flight=self.admission.in_flight,
            step=step,
            step_pause_s=ex.optimizer.step_pause_s,
            param_digest=digest,
            device=str(self.compute.device),
            dtype=self.compute.dtype_name,
            memory_bytes=self.memory_bytes,
            device_memory_bytes=self._device_memory_bytes,
            averaging=self.config.averaging.average,
        )

    async def drain(self) -> None:
        """Stop taking new work, finish what is in flight and what trainers will still ask (backward for
        microbatches this peer ran forward), all within ``drain_timeout_s``."""
        if self.state != PeerState.SERVING:  # draining already, or moving: its drain is under way
            return
        self._announcer.heading_to(None)  # leaving the swarm, not moving within it
        await self._drain_work()
        await self.save_checkpoint()
        logger.info("%s", self.summary())  # what it leaves behind, counted to the end

    async def move_to(self, stage_index: int, *, expected_throughput: float) -> bool:
        """Leave the current stage for ``stage_index``: drain (handing its samples in to the stage's all-reduce),
        load the new stage's state, serve it. Returns False, doing nothing, unless the peer is serving (a drain or
        another move is under way)."""
        if self.state != PeerState.SERVING:
            logger.info(
                "peer %s is %s: not moving to stage %d", self.peer_id, self.state, stage_index
            )
            return False
        old = self.stage_index
        self._announcer.heading_to(stage_index, expected_throughput)
        await self._drain_work()
        # what it leaves behind in the old stage, counted to the end
        logger.info("%s", self.summary())
        # Out of the old stage from here: its replicas must not count this peer (its Info says "starting", see
        # StageSteps.close_batch), the step loop must not touch the optimizer being shut down (it would schedule
        # this replica into the next step's group), and the shutdown runs on the compute thread, after the step
        # loop's last check. A move that fails from here leaves the peer serving nothing (it says why).
        self._between_stages, self.state = True, PeerState.STARTING
        # A gradient still held here would be applied to a replica that no longer averages (lost, yet reported
        # applied): refuse its late commit instead, and its caller computes it again in the stage.
        dropped = await self._worker.compute_urgent(
            self.executor.drop_held,
            f"peer {self.peer_id} left stage {old} for stage {stage_index} before the commit came",
        )
        if dropped:
            logger.info("peer %s left %d uncommitted gradients behind", self.peer_id, dropped)
        logger.info("peer %s left stage %d; loading stage %d", self.peer_id, old, stage_index)
        await self._worker.compute_urgent(self.executor.optimizer.shutdown)
        executor, source = await self._build_executor(stage_index, moving=True)
        self.executor, self.stage_index = executor, stage_index
        self._between_stages = False
        self._summary_mark = (time.monotonic(), 0, executor.busy_s)
        self._saved_step = executor.step
        self.admission.end_drain()
        self.state = PeerState.SERVING
        self._announcer.settled()
        await self._announcer.announce()
        logger.info(
            "peer %s moved from stage %d to stage %d (%s)", self.peer_id, old, stage_index, source
        )
        return True

    def request_move(self) -> asyncio.Task | None:
        """An operator's request (SIGUSR1 to ``swarm peer``): move now to the stage that needs this peer most, whatever
        the rebalancing thresholds and cooldown (see :func:`~swarm.peer.rebalancer.neediest_other_stage`). Runs in
        the background (the task says whether the peer moved); a request while one is under way is ignored (None).
        Call it on the peer's event loop."""
        if self._requested_move is not None and not self._requested_move.done():
            logger.info("peer %s: a requested move is under way; request ignored", self.peer_id)
            return None
        self._requested_move = asyncio.create_task(
            self._move_on_request(), name=f"move-{self.peer_id}"
        )
        return self._requested_move

    async def _move_on_request(self) -> bool:
        try:
            stage_index = await neediest_other_stage(
                self.directory, self.run.model, peer_id=self.peer_id, current=self.stage_index
            )
            if stage_index is None:
                return False
            # its speed where it goes: the same work per second, converted by the stages' relative costs
            costs = stage_costs(self.run.model)
            expected = self.throughput * costs[self.stage_index] / costs[stage_index]
            return await self.move_to(stage_index, expected_throughput=expected)
        except Exception as e:  # an operator's request must not kill the peer
            logger.warning("peer %s: the requested move failed: %s", self.peer_id, e)
            return False

    async def _stop_requested_move(self) -> None:
        if self._requested_move is not None:
            self._requested_move.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._requested_move

    async def _drain_work(self) -> None:
        self.state = PeerState.DRAINING
        self.admission.begin_drain()
        logger.info("peer %s draining (at most %.0fs)", self.peer_id, self.config.drain_timeout_s)
        if not self.dht_lost.is_set():  # (a lost node would hold it to the drain's end)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self._announcer.announce(), timeout=max(0.1, self.admission.drain_left_s)
                )
        # Trainers stop routing new forwards here once they see the draining state (in a reply or the
        # DHT); until the cached microbatches are claimed by their backward, keep serving, and until the
        # gradients held for a commit got it (a push call's comes after the call, through the Commit RPC).
        await self.admission.wait_until_drained(
            lambda: self.executor.cached_microbatches + self.executor.awaiting_commit
        )
        await self._hand_in_samples()

    async def _hand_in_samples(self) -> None:
        """An averaging replica that holds samples of its stage's current batch takes part in that batch's step
        before it leaves (the trainer closes the batch with it counted, see Pipeline.close_batch), within what
        is left of ``drain_timeout_s``: leaving with them would drop them from the stage's average."""
        optimizer = self.executor.optimizer
        if not getattr(optimizer, "holds_unaveraged", False):
            return
        step = self.executor.step
        while optimizer.holds_unaveraged and self.admission.drain_left_s > 0:
            await asyncio.sleep(self.config.averaging.step_check_s)  # the step loop takes the step
        if optimizer.holds_unaveraged:
            logger.warning(
                "peer %s leaves stage %d with %d samples of step %d its stage did not average (the drain "
                "timeout ran out first; raise --drain-timeout-s)",
                self.peer_id,
                self.stage_index,
                self.executor.samples_accumulated,
                self.executor.step,
            )
        else:
            logger.info(
                "peer %s handed its samples of step %d to its stage's all-reduce before leaving",
                self.peer_id,
                step,
            )

    async def shutdown(self) -> None:
        """Stop everything the peer started. Without its DHT node, within SHUTDOWN_WITHOUT_DHT_S: what still
        waits on the node then is left to the process's exit."""
        if self.dht_lost.is_set():
            try:
                await asyncio.wait_for(self._stack.aclose(), SHUTDOWN_WITHOUT_DHT_S)
            except asyncio.TimeoutError:
                logger.error(
                    "peer %s: its shutdown waited %.0fs on its lost DHT node; leaving the rest to the process's exit",
                    self.peer_id,
                    SHUTDOWN_WITHOUT_DHT_S,
                )
        else:
            await self._stack.aclose()
        self.stopped.set()

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def addresses(self) -> list[str]:
        """Its DHT node's multiaddrs, as the node gave them at the start."""
        return list(self._dht_addresses)


def _joins_from_checkpoint(
    published: RunConfig, proposed: RunConfig, pretrained: str | None
) -> bool:
    """Whether a peer given only --pretrained (its config proposed from the checkpoint) joins the published run:
    it needs the flag for the weights whatever the run is, so a run started from the same weights is joined with
    the owner's cut and hyperparameters."""
    sha = getattr(published.model, "pretrained_sha256", "")
    return (
        pretrained is not None
        and bool(sha)
        and sha == getattr(proposed.model, "pretrained_sha256", "")
    )


def _left_out(samples: int) -> str:
    """The summary's note of samples applied here that reached no step of the stage (none: no note)."""
    return f", {samples} samples applied here left out of their step" if samples else ""
