"""Every use of hivemind's private API in swarm, for hivemind 1.1.12 only.

``hivemind.Optimizer.step()`` accumulates, decides when to step, averages and steps in one call, on its own
rules (a time estimate of the batch's end, any group that forms). A stage needs those pieces apart (see
``swarm.averaging.optimizer``): accumulation on each commit, the step only on a full global batch and a formed
group, and a state that a newcomer downloads consistently. hivemind offers no public hook for that, so this
module subclasses its classes and calls a few of its private methods, each with a one-line reason. Nothing
else in swarm touches hivemind's private names or subclasses its classes.

Private names change between hivemind releases without notice, so importing this module checks the installed
version first and refuses any other than :data:`PINNED_HIVEMIND` with a sentence, instead of failing
mid-run on a missing method.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from typing import AsyncIterator  # noqa: UP035 (hivemind reads handler hints by typing's names)

import hivemind
import torch

from swarm.averaging.version import (  # noqa: F401 (the first two re-exported: this module's fence)
    PINNED_HIVEMIND,
    UnsupportedHivemind,
    check_hivemind_version,
)
from swarm.forking import protect_forks

check_hivemind_version()  # before the imports below, which may already fail on another version
protect_forks()  # the averagers are forked processes: see swarm.forking

import hivemind.averaging.allreduce  # noqa: E402
from hivemind.averaging.partition import TensorPartReducer  # noqa: E402
from hivemind.optim.grad_averager import GradientAverager  # noqa: E402
from hivemind.optim.progress_tracker import ProgressTracker  # noqa: E402
from hivemind.optim.state_averager import TrainingStateAverager  # noqa: E402
from hivemind.p2p import P2PContext  # noqa: E402
from hivemind.proto import averaging_pb2  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402

logger = logging.getLogger(__name__)


class ExactDeltaReducer(TensorPartReducer):
    """Makes every member of an all-reduce group end with bit-identical averages, so replicas stay bit-identical
    (their parameter digests agree) rather than drift apart by rounding.

    hivemind's reducer of a part sends each member ``average - member's part``, which the member adds to its part.
    In float32 that round trip rounds differently at each member. The difference of two float32 values is exact
    in float64, and a float32 plus that float64 difference is the average again, exactly: so the reducer returns
    the average as float64 (the delta then travels as float64, 8 bytes a value on the way back; the member's
    float32 ``add_`` computes in float64 and lands on the average). With a lossy ``--grad-compression`` the deltas
    are rounded on the wire and replicas agree only up to that rounding."""

    async def accumulate_part(self, *args, **kwargs) -> torch.Tensor:
        return (await super().accumulate_part(*args, **kwargs)).double()


# Private: AllReduceRunner builds its reducer by this module-level name; there is no parameter for the class.
# Set before any averager process forks, in every process that imports this module.
hivemind.averaging.allreduce.TensorPartReducer = ExactDeltaReducer


# The longest an all-reduce handler keeps its stream open for its caller to read the last results (see WholeResults)
RESULTS_HOLD_S = 5.0


class WholeResults:
    """Mixin for a hivemind averager (before it in the bases) whose all-reduce handler never closes a stream before
    its caller has read every result.

    An all-reduce part's results cross the groupmates' p2pd daemons, and hivemind's handler closed its end of the
    stream as soon as it had written the last of them: with those still on their way, the daemon could reset the
    stream and the caller got part of its results ("Averaging: received 70.6% results"; in bench/convergence.py's
    swarm in 9 of 13 runs of 20 steps, each a regroup and a state reload, and most of bench/soak.py's steps without
    the whole batch). The handler now keeps the stream open until the caller closes it, which hivemind's caller
    does once its result is whole (the all-reduce's end cancels its reads): the close cancels the wait, bounded by
    ``RESULTS_HOLD_S`` for a caller that never closes. Private override: hivemind's handler has no hook."""

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        last = None
        async for last in super().rpc_aggregate_part(stream, context):
            yield last
        if last is not None and last.code == averaging_pb2.AVERAGED_PART:
            await asyncio.sleep(RESULTS_HOLD_S)  # cancelled when the caller closes the stream


class SampleSumGradientAverager(WholeResults, GradientAverager):
    """A GradientAverager whose accumulators hold gradient SUMS and whose averaged result is sum/samples.

    hivemind's own accumulation assumes every call brings a mean gradient of equally sized batches
    (it rescales by the first batch size and divides by the number of calls); our microbatches vary in
    size and arrive as sums, so we accumulate sums and divide by the samples: the exact local mean,
    which the all-reduce then weights by samples into the exact global mean."""

    # group key bits of the next all-reduce (see keys.step_group_bits)
    step_key: Callable[[], str] | None = None
    # the replicas the next all-reduce group should hold (None or under 2: not known), and the longest it waits for
    # them (see schedule_step)
    group_size: Callable[[], int | None] | None = None
    group_wait_s: float | None = None

    def schedule_step(self, scheduled_time=None, **kwargs):
        # Every new all-reduce starts here (step() without a pre-scheduled group comes here too). hivemind
        # rewrites the key bits after each group it assembles, so set them for every one.
        if self.step_key is not None:
            self.set_group_bits(self.step_key(), wait=False)
        # hivemind's leader assembles its group at the time it declared (``scheduled_time``), with whoever joined by
        # then: a replica that looked for the group a moment later (its compute thread was busy, its view of the
        # stage's progress lagged) missed it and lost its samples of the batch. Told how many replicas to expect,
        # the group assembles as soon as they are all in, and waits for them up to ``group_wait_s``.
        size = self.group_size() if self.group_size is not None else None
        size = size if size is not None and size >= 2 else None
        self.set_group_size(size)
        if size is not None and scheduled_time is None and self.group_wait_s is not None:
            scheduled_time = get_dht_time() + self.group_wait_s
        return super().schedule_step(scheduled_time=scheduled_time, **kwargs)

    def set_group_size(self, size: int | None) -> None:
        """Expect ``size`` replicas in the group forming now (None: unknown): it assembles as soon as they have all
        joined, instead of at the end of the matchmaking time (hivemind's target group size, which it otherwise
        fixes at construction). Returns at once; the averager's process applies it in order with the rest."""
        self._outer_pipe.send(("_set_group_size", [], dict(size=size)))

    # Runs in the averager's process (hivemind calls it by name from the control pipe).
    async def _set_group_size(self, size: int | None) -> None:
        # Private: Matchmaking's target size and its leader's assembly, which have no public setter or trigger.
        matchmaking = self._matchmaking
        matchmaking.target_group_size = size
        if size is None:
            return
        async with matchmaking.lock_request_join_group:
            # already leading a full group (its members joined before the size was known): assemble it now
            if (
                matchmaking.is_looking_for_group
                and matchmaking.current_leader is None
                and not matchmaking.assembled_group.done()
                and len(matchmaking.current_followers) + 1 >= size
            ):
                await matchmaking.leader_assemble_group()

    # samples of earlier batches in the accumulators beside this batch's, by their batch (see carry_in): averaged with
    # it, never reported as its progress, or the stage would step before its batch is in (replaced, never mutated)
    carried: dict[int, int] = {}

    @property
    def carried_samples(self) -> int:
        return sum(self.carried.values())

    @torch.no_grad()
    def carry_in(self, sums: list[torch.Tensor | None], samples: dict[int, int]) -> None:
        """Add gradient sums (in the accumulators' order; None: zero) of earlier batches' samples (batch -> samples) to
        the accumulators: one step late rather than lost (see HivemindStageOptimizer.accumulate and _hand_over)."""
        added = sum(samples.values())
        self.local_samples_accumulated += added
        self.local_times_accumulated += 1
        carried = dict(self.carried)
        for batch, n in samples.items():
            carried[batch] = carried.get(batch, 0) + n
        self.carried = carried
        for grad_acc, late in zip(self._grad_accumulators(), sums):
            if late is not None:
                grad_acc.add_(late.to(grad_acc.device))

    @torch.no_grad()
    def reset_accumulated_grads_(self):
        super().reset_accumulated_grads_()
        self.carried = {}

    @property
    def batch_samples(self) -> int:
        """The samples accumulated of the current batch (the carried ones apart)."""
        return self.local_samples_accumulated - self.carried_samples

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int):
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1
        # Private readers: the parameters' .grad buffers and the accumulators have no public accessor.
        for grad_buf, grad_acc in zip(self._grads_from_parameters(), self._grad_accumulators()):
            grad_acc.add_(grad_buf.to(grad_acc.device))

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        scale = 1.0 / self.local_samples_accumulated if self.local_samples_accumulated else 0.0
        with self.get_tensors() as averaged_grads:
            # Private reader: the accumulators have no public accessor.
            for grad_acc, averaged_grad in zip(self._grad_accumulators(), averaged_grads):
                averaged_grad.copy_(grad_acc).mul_(scale)


class ThrottledEvent(threading.Event):
    """A ``threading.Event`` whose ``set`` takes effect at most once per ``interval_s``: one set within the interval
    of the last is put off to the interval's end, and any more meanwhile join it (0: at once, as an Event)."""

    def __init__(self, interval_s: float):
        super().__init__()
        self.interval_s = interval_s
        self._last = -float("inf")
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def set(self) -> None:
        with self._lock:
            wait_s = self._last + self.interval_s - time.monotonic()
            if wait_s <= 0:
                self._fire_locked()
            elif self._timer is None:
                self._timer = threading.Timer(wait_s, self._fire)
                self._timer.daemon = True
                self._timer.start()

    def set_now(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._fire_locked()

    def _fire(self) -> None:
        with self._lock:
            self._fire_locked()

    def _fire_locked(self) -> None:
        self._timer, self._last = None, time.monotonic()
        super().set()


class BatchTracker(ProgressTracker):
    """Ready to step when the stage has its global batch (or a peer already stepped past it), or when
    the batch is closed (the trainer has moved on: it will not grow). hivemind's tracker also steps when
    its time estimate for the batch passes; the trainer's microbatches arrive in bursts, so that would
    step on part of a batch and split the rest over the next step.

    ``report_every_s``: at most one store of this replica's progress record per that many seconds (0: one per
    report, as hivemind's). Each store is a DHT write that the peer's DHT process and its libp2p daemon carry out;
    a replica averaging directly reports at least once per step, and on two cores those two processes then took
    about a fifth of the machine (bench/results/convergence.md). Its records only tell peers that it stepped past
    them, or who is left to load state from, which a few seconds late still tells."""

    batch_closed = False
    # Seconds between reads of the stage's progress records (a DHT read each, carried out by the peer's DHT process and
    # its libp2p daemon); 0: hivemind's schedule, which reads as often as every ``min_refresh_period`` while it
    # expects the batch to fill soon, five times a second per replica at tiny's pace (bench/results/convergence.md).
    read_every_s = 0.0
    # the stage's replicas (not clients) whose records stand at the stage's step, this replica's own included, and
    # those one step behind it (still finishing the step before, or their record a heartbeat late)
    peers_at_epoch = 0
    peers_one_behind = 0

    # Private override: the only place the tracker reads every replica's record; hivemind keeps only the totals.
    def _parse_swarm_progress_data(self, metadata):
        progress = super()._parse_swarm_progress_data(metadata)
        entries = metadata.values() if isinstance(metadata, dict) else ()
        epochs = [
            entry.value.get("epoch")
            for entry in entries
            if isinstance(entry.value, dict) and not entry.value.get("client_mode")
        ]
        self.peers_at_epoch = sum(1 for epoch in epochs if epoch == progress.epoch)
        self.peers_one_behind = sum(1 for epoch in epochs if epoch == progress.epoch - 1)
        if self.read_every_s > 0:
            progress.next_fetch_time = get_dht_time() + self.read_every_s
        return progress

    def read_soon(self) -> None:
        """Read the stage's progress records now, not at the next scheduled read (any thread)."""
        # Private: the reading loop waits on this event up to next_fetch_time, then reads once that has passed.
        self.global_progress.next_fetch_time = get_dht_time()
        self.global_state_updated.set()

    def read_fresh(self, timeout_s: float) -> bool:
        """Read the stage's progress records now and wait for the reading (False: none came within ``timeout_s``;
        ``global_progress`` is then the last one read). Blocks: not on an event loop."""
        before = self.global_progress  # each reading replaces it
        self.read_soon()
        deadline = time.monotonic() + timeout_s
        while self.global_progress is before:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    @property
    def ready_to_update_epoch(self) -> bool:
        return (
            self.global_epoch > self.local_progress.epoch
            or self.global_progress.samples_accumulated >= self.target_batch_size
            or self.batch_closed
        )

    # Private override: with report_every_s, hivemind's reporting loop would stop writing this replica's record. It
    # writes only while the peer has reported samples within an epoch of the stage's (a peer without is an auxiliary
    # one), and it looks at the samples when it wakes: a replica whose writes are spaced out wakes between its steps
    # often enough to look like one, and its peers then no longer see it (a newcomer could not find the stage's
    # state: bench/soak.py). This loop writes on every wake, which the event spaces out.
    async def _progress_reporter(self):
        event = self.should_report_progress
        if not isinstance(event, ThrottledEvent) or event.interval_s <= 0:
            return await super()._progress_reporter()
        loop = asyncio.get_running_loop()
        writing = None
        try:
            while not self.shutdown_triggered.is_set():
                # woken by a report (spaced out by the event), or in time to write again before the record expires
                await loop.run_in_executor(None, event.wait, self.metadata_expiration / 3)
                event.clear()
                if self.shutdown_triggered.is_set():
                    break
                if writing is not None and not writing.done():
                    continue  # the DHT is slow: the next wake writes the newest progress
                written_at = get_dht_time()
                writing = asyncio.ensure_future(
                    asyncio.wait_for(
                        self.dht.store(
                            key=self.training_progress_key,
                            subkey=self._local_public_key,
                            value=self.local_progress.dict(),
                            expiration_time=written_at + self.metadata_expiration,
                            return_future=True,
                        ),
                        timeout=self.metadata_expiration,
                    )
                )
                # a write that failed is followed by the next (the error is the DHT's to log)
                writing.add_done_callback(lambda done: done.cancelled() or done.exception())
        finally:
            if writing is not None:
                writing.cancel()

    def shutdown(self, timeout: float | None = None):
        if isinstance(self.should_report_progress, ThrottledEvent):
            # its reporting thread ends at once, not put off
            self.should_report_progress.interval_s = 0.0
        super().shutdown(timeout)


class ConsistentStateAverager(TrainingStateAverager):
    """Serves (step, parameters, optimizer state) taken together. hivemind counts the step up before the
    optimizer step runs and reads the parameters without the step's lock, so a newcomer downloading during a
    peer's step could get the old parameters labelled with the new step, or a half-updated mix."""

    _loading = False  # inside load_state_from_peers
    _loaded_step: int | None = None
    # At most one declaration of a higher state-sharing priority per this many seconds (0: one per change, as
    # hivemind's). Each is a DHT store its DHT process and libp2p daemon carry out, and a replica raises its priority
    # at every step (its step is its priority); see the setter.
    declare_every_s = 0.0
    _declared_at = -float("inf")

    def __init__(self, **kwargs):
        # before the base class starts the thread that serves the state
        self.state_lock = threading.Lock()
        super().__init__(**kwargs)

    @property
    def state_sharing_priority(self) -> float:
        return TrainingStateAverager.state_sharing_priority.fget(self)

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        """A higher priority within ``declare_every_s`` of the last declaration is declared with the next one (the
        next step's past the interval, or hivemind's periodic one): a donor that ranks a step too low in the
        meantime still serves its current state, labelled with its own step. A lower one (a doubtful replica) is
        declared at once."""
        now = time.monotonic()
        if value > self.state_sharing_priority and now - self._declared_at < self.declare_every_s:
            # Private: the value hivemind's averager process declares; set without waking it
            self._state_sharing_priority.value = value
            return
        self._declared_at = now
        TrainingStateAverager.state_sharing_priority.fset(self, value)

    def get_current_state(self):
        """The state as it is now, copied under the lock. hivemind's ``param.cpu()`` is the live tensor itself for a
        stage on the CPU (and so is every optimizer statistic there): the averager process that streams the state to
        the downloading replica reads it seconds later, through shared memory, while this replica's next optimizer
        steps write it, and the replica that loads it ends up with parameters of two steps. A stage on a GPU gets
        fresh copies from ``.cpu()`` and copies nothing more."""
        with self.state_lock:
            metadata, tensors, infos = super().get_current_state()
            live = {t.untyped_storage().data_ptr() for t in self._live_tensors()}
            tensors = [t.clone() if t.untyped_storage().data_ptr() in live else t for t in tensors]
            return metadata, tensors, infos

    def _live_tensors(self):
        """Every tensor the state is read from: the optimized parameters, the extra tensors and the optimizer's
        statistics."""
        for group in self.optimizer.param_groups:
            yield from group["params"]
        yield from self.extra_tensors
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def load_state_from_peers(self, **kwargs) -> int | None:
        """hivemind's download from the most advanced peer (it refuses a state older than this replica's step),
        under the state lock: nobody downloads a half-loaded state from this replica, and two replicas that ask
        each other at once cannot swap states (one waits for the other). Returns the step loaded, or None."""
        with self.state_lock:
            self._loaded_step, self._loading = None, True
            try:
                super().load_state_from_peers(**kwargs)
            finally:
                self._loading = False
            return self._loaded_step

    # Private override: the base class calls it last in a successful load, the only sign that the load succeeded.
    def _update_scheduler(self):
        if self._loading:
            self._loaded_step = self.local_epoch
        super()._update_scheduler()

    def step(self, *args, **kwargs):
        with self.state_lock if kwargs.get("increment_epoch") else contextlib.nullcontext():
            return super().step(*args, **kwargs)


class GlobalBatchOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that remembers when a step fell back to local gradients (no all-reduce group), whose
    stage steps on a full global batch only (:class:`BatchTracker`), and whose replicas share a consistent state
    (:class:`ConsistentStateAverager`). Its all-reduce groups are keyed by step in the gradient averager
    (:class:`SampleSumGradientAverager`)."""

    used_local_gradients = False

    # Private override: the only way to give hivemind.Optimizer another progress tracker class.
    def _make_progress_tracker(
        self,
        target_batch_size: int,
        report_every_s: float = 0.0,
        read_every_s: float = 0.0,
        **kwargs,
    ):
        tracker = BatchTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=False,
            **kwargs,
        )
        # before its reporting thread starts waiting on the event, and its reading thread on its schedule
        tracker.should_report_progress = ThrottledEvent(report_every_s)
        tracker.read_every_s = read_every_s
        tracker.start()
        return tracker

    # Private override: the only way to give hivemind.Optimizer another state averager class (its arguments
    # copied from hivemind.Optimizer._make_state_averager).
    def _make_state_averager(self, **kwargs):
        return ConsistentStateAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    # Private override: hivemind falls back to local gradients silently (a log line); the stage must know.
    def _load_local_gradients_into_optimizer(self):
        self.used_local_gradients = True
        super()._load_local_gradients_into_optimizer()


def accumulate_gradients(
    opt: GlobalBatchOptimizer, num_samples: int, *, report: bool = True
) -> None:
    """Add the parameters' .grad to the accumulators and, with ``report``, report the batch's samples to the stage's
    progress (a DHT store)."""
    # What hivemind's private _check_and_accumulate_gradients does without a grad scaler, but reporting the batch's
    # samples only: samples carried from the batch before (SampleSumGradientAverager.carry_in) are not this batch's.
    opt.grad_averager.accumulate_grads_(num_samples)
    if report:
        opt.tracker.report_local_progress(opt.local_epoch, opt.grad_averager.batch_samples)


def schedule_gradient_averaging(opt: GlobalBatchOptimizer) -> None:
    """Start looking for the next all-reduce group if the batch is expected to fill within matchmaking time."""
    # Private: step() does this only as part of a call that may also step; we schedule between commits.
    # hivemind computes the batch's ETA here, logs it and does not pass it to schedule_step. Passing it would change
    # nothing: it schedules only once the ETA is within matchmaking_time, then raises it to min_matchmaking_time,
    # which the Optimizer sets to that same matchmaking_time, and schedule_step's default start is now plus
    # min_matchmaking_time. (Where the trainer has counted the replicas, SampleSumGradientAverager.schedule_step
    # starts the group later still, at group_wait_s, and assembles it as soon as they are all in.)
    opt._maybe_schedule_gradient_averaging()


def begin_global_step(opt: GlobalBatchOptimizer) -> bool:
    """Hand the accumulated gradients to the all-reduce of the group that formed and return at once; False if no
    group formed (the step then uses this replica's gradients). The first half of hivemind's global step
    (``Optimizer._update_global_epoch``), which then blocks for the all-reduce: the compute thread must not (a
    groupmate killed mid all-reduce would hold it for ``averaging_timeout_s``).

    Whether to average is the formed group's to say, not the progress records': hivemind's own first half skips a
    formed group when its records show one peer, and they lag on a loaded machine (a replica then stepped alone on
    its half of the batch, silently, and its groupmate waited out ``next_chunk_timeout`` for its part)."""
    # Private: the halves of _update_global_epoch for our settings (gradient averaging, no delayed or local updates,
    # no state averaging), so that the wait between them happens off the compute thread.
    control = opt.scheduled_grads
    if control is None or control.triggered or control.done():
        opt.scheduled_grads = None
        return False
    with opt.tracker.pause_updates():
        try:
            opt.scheduled_grads = opt.grad_averager.step(
                # the sums stay until the step is taken (finish_global_step resets them): an all-reduce that fails
                # can be run again with another group on the same gradients
                control=control,
                reset_accumulators=False,
                wait=False,
            )
            return True
        except Exception:
            logger.exception("handing the gradients to the all-reduce failed; leaving the group")
            if not control.done():
                tag_along_with_zero_weight(opt, control)
            opt.scheduled_grads = None
            return False


def forget_averaged(opt: GlobalBatchOptimizer) -> None:
    """An all-reduce's result is dropped (it is run again): tell the averager, or it warns at the next one."""
    opt.grad_averager.notify_used_averaged_gradients()


def finish_global_step(
    opt: GlobalBatchOptimizer, began: bool, averaged: torch.Tensor | None = None
) -> None:
    """Once the all-reduce ``begin_global_step`` started is done (or none was): load the averaged gradients (this
    replica's own if there was no group or the all-reduce failed), step, and count the step. ``averaged``: the
    flat average of another all-reduce (swarm.averaging.direct), in the accumulators' order, to step on instead."""
    # Private: the second half of _update_global_epoch (see begin_global_step). hivemind's version loads no
    # gradients into the optimizer when no all-reduce began (it relies on .grad, which we leave empty): load the
    # replica's own then, or a replica alone would step on nothing.
    with opt.tracker.pause_updates():
        if averaged is not None:
            _load_flat_average(opt, averaged)
        elif began:
            opt._average_gradients_and_load_into_optimizer(opt.scheduled_grads)
        else:
            opt._load_local_gradients_into_optimizer()
        opt.state_averager.step(increment_epoch=True, optimizer_step=True)
        opt.tracker.update_epoch(new_epoch=opt.state_averager.local_epoch)
        opt.state_averager.state_sharing_priority = opt.local_epoch
        opt.grad_averager.reset_accumulated_grads_()  # (its state is not shared: no priority to raise)


@torch.no_grad()
def _load_flat_average(opt: GlobalBatchOptimizer, averaged: torch.Tensor) -> None:
    """Put ``averaged`` where hivemind's all-reduce leaves its result, and load that into the optimizer."""
    # Private: the averaged tensors and their loader have no public counterpart outside hivemind's own step.
    with opt.grad_averager.get_tensors() as tensors:
        numel = sum(tensor.numel() for tensor in tensors)
        if numel != averaged.numel():
            raise ValueError(f"an average of {averaged.numel()} values for gradients of {numel}")
        start = 0
        for tensor in tensors:
            tensor.copy_(averaged[start : start + tensor.numel()].view_as(tensor))
            start += tensor.numel()
    opt._load_averaged_gradients_into_optimizer_()


def tag_along_with_zero_weight(opt: GlobalBatchOptimizer, control) -> None:
    """Take part in an all-reduce that counts on this replica with weight 0, then let it finish."""
    # Private: no public way to leave a formed group without stalling it until its timeout.
    opt._tag_along_with_zero_weight(control)


def gradient_accumulators(opt: GlobalBatchOptimizer) -> list[torch.Tensor]:
    """The gradient averager's accumulators (sums since the last step), in the optimizer's parameter order."""
    # Private: the accumulators have no public accessor.
    return list(opt.grad_averager._grad_accumulators())


@contextlib.contextmanager
def keep_sigint_handler():
    """hivemind's averagers set SIGINT to "ignore" in the calling process as they start their own processes.
    Keep the caller's handler (Ctrl-C drains a peer): restore it afterwards on the main thread; elsewhere
    (a peer run inside another program's thread), where Python refuses signal.signal, skip hivemind's call."""
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGINT)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
        return
    # Process-wide patch: hivemind's Averager.run_in_background calls signal.signal unconditionally.
    original = signal.signal
    signal.signal = lambda sig, handler: signal.getsignal(sig)
    try:
        yield
    finally:
        signal.signal = original


class PartialResults(logging.Filter):
    """Counts hivemind all-reduces that ended with part of the result missing (a groupmate's part timed out: the
    replica keeps its own values there, so its parameters leave its peers'). hivemind reports that only as a log
    warning, in its averager's process; this filter, installed before that process forks, counts it in shared
    memory so the compute thread can tell after a step."""

    # Private: hivemind's log text is the only report of a partial all-reduce (no return value, no counter).
    MESSAGE = "Averaging: received"
    SOURCE = "hivemind.averaging.partition"
    _installed: PartialResults | None = None

    def __init__(self):
        super().__init__()
        self.count = multiprocessing.Value("l", 0)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(self.MESSAGE):
            with self.count.get_lock():
                self.count.value += 1
        return True

    @classmethod
    def install(cls) -> PartialResults:
        if cls._installed is None:
            cls._installed = cls()
            source = logging.getLogger(cls.SOURCE)
            source.addFilter(cls._installed)
            # filters only see records the logger lets through
            if not source.isEnabledFor(logging.WARNING):
                source.setLevel(logging.WARNING)
        return cls._installed
