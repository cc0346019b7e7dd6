"""One stage's optimizer: the peers of a stage accumulate toward one global batch, all-reduce and step together.

Two implementations share one small interface (:class:`StageOptimizer`), so the executor does not care
which it has:

* :class:`LocalStageOptimizer` steps alone when this replica has seen ``target_batch_size`` samples (an
  executor built outside a peer: unit tests, tools).
* :class:`HivemindStageOptimizer` wraps ``hivemind.Optimizer`` with run id ``f"{run_id}_stage{k}"``: commits
  report samples to the stage's progress tracker; when the stage as a whole has the global batch, every
  peer of the stage averages its gradient sums weighted by samples (exact global mean) and steps.

Why synchronous (``delay_optimizer_step=False``, ``delay_grad_averaging=False``, no local updates): the
optimizer step runs on the peer's compute thread, so it never races a forward or backward and the swarm
optimises exactly what the single-process model does (no stale parameters). The price is that compute
pauses during the all-reduce; hivemind starts matchmaking ``matchmaking_s`` before the batch is
expected to fill, so the pause is mostly the all-reduce itself (tokens/s in bench/results/convergence.md). The
delayed modes would run the step on hivemind's thread and write parameters under a running backward
(or, with an offloaded optimizer, apply one step late), which breaks the parity the issue asks for.

How the replicas of a stage stay equal (each rule closes a way they drifted apart in measurements):

* an all-reduce group only joins replicas at the same step (its key holds the step): a replica one step behind
  never adds its gradients of another batch to its peers' average;
* a replica never waits for a group on its compute thread: if its peers' group assembled without it, they step
  without its samples of that batch and it loads their state;
* a replica that stepped on partial results (a groupmate's part timed out: hivemind keeps the local values
  there and only logs it), on its own gradients, or skipped a non-finite step, reloads its peers' state;
* a donor serves its step, parameters and optimizer state together (hivemind counts the step up before the
  update and reads parameters without the update's lock), and a loaded state keeps its own step: hivemind's
  "catching up" would label a state one step old with the stage's step.

Gradient clipping needs the norm over all stages, which no single stage knows. Approximation used: each
stage clips its own gradient to ``max_grad_norm / sqrt(num_stages)``. The global norm after clipping is
then always <= ``max_grad_norm``, and when the stages' norms are equal this is exactly global clipping.
Its effect versus exact clipping is measured in bench/convergence.py (bench/results/convergence.md).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from swarm.config import RunConfig
from swarm.model import Stage, adamw_param_groups

logger = logging.getLogger(__name__)

GRAD_COMPRESSIONS = ("none", "fp16", "scaled-fp16")


@dataclass(frozen=True, kw_only=True)
class AveragingConfig:
    average: bool = False  # experimental: all-reduce gradients with this stage's other peers and step together (hivemind)
    matchmaking_s: float = 2.0  # seconds peers of a stage spend forming an all-reduce group before a step
    averaging_timeout_s: float = 30.0  # an all-reduce that takes longer is abandoned (the step uses local grads)
    # A groupmate silent this long mid all-reduce is dropped from it (the replicas that miss its part reload: see
    # HivemindStageOptimizer._global_step). Long enough for a groupmate whose view of the stage lags (its DHT reads
    # stall for seconds on a loaded machine).
    chunk_timeout_s: float = 10.0
    load_state_timeout_s: float = 60.0  # how long a newcomer waits for its stage's state from peers
    grad_compression: str = "none"  # gradient all-reduce codec: none, fp16 or scaled-fp16
    step_check_s: float = 0.1  # seconds between checks whether the stage's global batch is full

    def __post_init__(self):
        if self.grad_compression not in GRAD_COMPRESSIONS:
            raise ValueError(f"grad_compression '{self.grad_compression}' is unknown; choose one of "
                             f"{', '.join(GRAD_COMPRESSIONS)} (hivemind's 8-bit codecs fail under numpy 2)")
        if min(self.matchmaking_s, self.averaging_timeout_s, self.chunk_timeout_s, self.load_state_timeout_s,
               self.step_check_s) <= 0:
            raise ValueError(f"matchmaking_s ({self.matchmaking_s}), averaging_timeout_s ({self.averaging_timeout_s}), "
                             f"chunk_timeout_s ({self.chunk_timeout_s}), load_state_timeout_s "
                             f"({self.load_state_timeout_s}) and step_check_s ({self.step_check_s}) must be > 0")


def stage_run_id(run_id: str, stage: int) -> str:
    """hivemind run id of one stage's averaging (hivemind forbids '.' in its prefixes)."""
    return f"{run_id.replace('.', '_')}_stage{stage}"


def stage_clip_norm(run: RunConfig) -> float:
    """The per-stage clipping threshold that bounds the global norm by ``run.max_grad_norm`` (0 = off)."""
    return run.max_grad_norm / math.sqrt(run.model.num_stages)


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips its parameters' gradient norm to ``max_grad_norm`` first (0 = off) and skips a
    step whose gradient is not finite (the gradients are dropped, the parameters stay)."""

    def __init__(self, params, *, max_grad_norm: float, **kwargs):
        super().__init__(params, **kwargs)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm = float("nan")
        self.skipped_steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm if self.max_grad_norm > 0 else math.inf)
        self.last_grad_norm = float(norm)
        if not math.isfinite(self.last_grad_norm):
            logger.error("gradient norm is %s: skipping this optimizer step", self.last_grad_norm)
            self.skipped_steps += 1
            self.zero_grad(set_to_none=True)
            return None
        return super().step(closure)


def build_stage_optimizer(params, run: RunConfig, *, lr: float | None = None) -> ClippedAdamW:
    """The optimizer every replica of a stage and the single-process reference use (same hyperparameters);
    callers set each step's learning rate from ``run.lr_at``."""
    if isinstance(params, torch.nn.Module):
        params = adamw_param_groups(params, run.weight_decay)
    return ClippedAdamW(params, lr=run.lr_at(0) if lr is None else lr, betas=(0.9, 0.95),
                        max_grad_norm=stage_clip_norm(run))


class StageOptimizer(Protocol):
    """What the executor needs. ``accumulate`` takes gradient SUMS over ``num_samples`` samples (one
    microbatch) in ``stage.parameters()`` order, toward optimizer step ``batch_step`` (None: the current
    one), and returns True when the parameters changed."""

    epoch: int
    local_samples: int
    step_pause_s: float  # seconds a step typically holds the compute thread beyond the update itself

    def accumulate(self, grads: list[torch.Tensor | None], num_samples: int, batch_step: int | None = None) -> bool: ...
    def maybe_step(self) -> bool: ...
    def grad_sums(self) -> list[torch.Tensor]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def shutdown(self) -> None: ...


class LaterBatches:
    """Gradient sums of microbatches that belong to a later optimizer step than the stage's current one,
    kept aside until the stage gets there (the trainer streams the next batch while the stage still waits
    for the last microbatches of this one). Steps more than ``max_ahead`` ahead are kept with the step
    ``max_ahead`` ahead, so memory stays at ``max_ahead`` gradient copies whatever the callers send."""

    def __init__(self, max_ahead: int = 4):
        self.max_ahead = max_ahead
        self._by_step: dict[int, tuple[list[torch.Tensor | None], int]] = {}

    def add(self, step: int, current: int, grads: list[torch.Tensor | None], num_samples: int) -> None:
        step = min(step, current + self.max_ahead)
        held = self._by_step.get(step)
        if held is None:
            self._by_step[step] = ([None if g is None else g.detach().clone() for g in grads], num_samples)
            return
        sums, n = held
        for i, g in enumerate(grads):
            if g is not None:
                sums[i] = g.detach().clone() if sums[i] is None else sums[i].add_(g)
        self._by_step[step] = (sums, n + num_samples)

    def pop_due(self, current: int) -> tuple[list[torch.Tensor | None], int] | None:
        """The oldest batch kept for a step the stage has reached, if any."""
        due = [step for step in self._by_step if step <= current]
        return self._by_step.pop(min(due)) if due else None


class LocalStageOptimizer:
    """Steps alone whenever this replica has accumulated ``target_batch_size`` samples. It counts every
    sample toward its own next step (``batch_step`` is ignored): with no peers to agree with, the count
    alone is exact."""

    def __init__(self, stage: Stage, run: RunConfig):
        self.stage, self.run = stage, run
        self.params = list(stage.parameters())
        self.optimizer = build_stage_optimizer(stage, run)
        self.epoch = 0
        self.local_samples = 0
        self.step_pause_s = 0.0  # no all-reduce
        self._sums = [torch.zeros_like(p) for p in self.params]

    def accumulate(self, grads, num_samples, batch_step=None):
        for acc, g in zip(self._sums, grads):
            if g is not None:
                acc.add_(g)
        self.local_samples += num_samples
        return self.maybe_step()

    def maybe_step(self) -> bool:
        if self.local_samples < self.run.target_batch_size:
            return False
        for p, acc in zip(self.params, self._sums):
            p.grad = acc / self.local_samples  # the mean gradient over the global batch
        _set_lr(self.optimizer, self.run, self.epoch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for acc in self._sums:
            acc.zero_()
        self.local_samples = 0
        self.epoch += 1
        return True

    def grad_sums(self):
        return [acc.clone() for acc in self._sums]

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.epoch = int(state["epoch"])

    def shutdown(self) -> None:
        pass


def _set_lr(optimizer: torch.optim.Optimizer, run: RunConfig, step: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = run.lr_at(step)


def _compression(name: str):
    from hivemind.compression import Float16Compression, NoCompression, ScaledFloat16Compression

    return {"none": NoCompression, "fp16": Float16Compression, "scaled-fp16": ScaledFloat16Compression}[name]()


def _sample_sum_averager_factory(request_timeout: float):
    """A GradientAverager whose accumulators hold gradient SUMS and whose averaged result is sum/samples.

    hivemind's own accumulation assumes every call brings a mean gradient of equally sized batches
    (it rescales by the first batch size and divides by the number of calls); our microbatches vary in
    size and arrive as sums, so we accumulate sums and divide by the samples: the exact local mean,
    which the all-reduce then weights by samples into the exact global mean."""
    from hivemind.optim.grad_averager import GradientAverager

    class SampleSumGradientAverager(GradientAverager):
        step_key: Callable[[], str] | None = None  # group key bits of the next all-reduce (see epoch_group_bits)

        def schedule_step(self, *args, **kwargs):
            # Every new all-reduce starts here (step() without a pre-scheduled group comes here too). hivemind
            # rewrites the key bits after each group it assembles, so set them for every one.
            if self.step_key is not None:
                self.set_group_bits(self.step_key(), wait=False)
            return super().schedule_step(*args, **kwargs)

        @torch.no_grad()
        def accumulate_grads_(self, batch_size: int):
            self.local_samples_accumulated += batch_size
            self.local_times_accumulated += 1
            for grad_buf, grad_acc in zip(self._grads_from_parameters(), self._grad_accumulators()):
                grad_acc.add_(grad_buf.to(grad_acc.device))

        @torch.no_grad()
        def load_accumulators_into_averager_(self):
            scale = 1.0 / self.local_samples_accumulated if self.local_samples_accumulated else 0.0
            with self.get_tensors() as averaged_grads:
                for grad_acc, averaged_grad in zip(self._grad_accumulators(), averaged_grads):
                    averaged_grad.copy_(grad_acc).mul_(scale)

    return functools.partial(SampleSumGradientAverager, request_timeout=request_timeout)


@contextlib.contextmanager
def _keep_sigint_handler():
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

    MESSAGE = "Averaging: received"
    _installed: PartialResults | None = None

    def __init__(self):
        super().__init__()
        import multiprocessing

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
            source = logging.getLogger("hivemind.averaging.partition")
            source.addFilter(cls._installed)
            if not source.isEnabledFor(logging.WARNING):  # filters only see records the logger lets through
                source.setLevel(logging.WARNING)
        return cls._installed


EPOCH_KEY_BITS = 32


def epoch_group_bits(epoch: int) -> str:
    """The all-reduce group key bits of optimizer step ``epoch``: replicas at different steps never share a group
    (a replica one step behind would otherwise add its gradients of another batch to its peers' average)."""
    return format(epoch % 2 ** EPOCH_KEY_BITS, f"0{EPOCH_KEY_BITS}b")


def _optimizer_class():
    """hivemind.Optimizer that remembers when a step fell back to local gradients (no all-reduce group), whose
    stage steps on a full global batch only (see ``BatchTracker``), and whose replicas share a consistent state
    (see ``ConsistentStateAverager``). Its all-reduce groups are keyed by step in the gradient averager
    (``_sample_sum_averager_factory``)."""
    import hivemind
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.optim.state_averager import TrainingStateAverager

    class BatchTracker(ProgressTracker):
        """Ready to step when the stage has its global batch (or a peer already stepped past it), or when
        the batch is closed (the trainer has moved on: it will not grow). hivemind's tracker also steps when
        its time estimate for the batch passes; the trainer's microbatches arrive in bursts, so that would
        step on part of a batch and split the rest over the next step."""

        batch_closed = False

        @property
        def ready_to_update_epoch(self) -> bool:
            return (self.global_epoch > self.local_progress.epoch
                    or self.global_progress.samples_accumulated >= self.target_batch_size
                    or self.batch_closed)

    class ConsistentStateAverager(TrainingStateAverager):
        """Serves (epoch, parameters, optimizer state) taken together. hivemind counts the epoch up before the
        optimizer step runs and reads the parameters without the step's lock, so a newcomer downloading during a
        peer's step could get the old parameters labelled with the new step, or a half-updated mix."""

        _loading = False  # inside load_state_from_peers
        _loaded_epoch: int | None = None

        def __init__(self, **kwargs):
            self.state_lock = threading.Lock()  # before the base class starts the thread that serves the state
            super().__init__(**kwargs)

        def get_current_state(self):
            with self.state_lock:
                return super().get_current_state()

        def load_state_from_peers(self, **kwargs) -> int | None:
            """hivemind's download from the most advanced peer (it refuses a state older than this replica's step),
            under the state lock: nobody downloads a half-loaded state from this replica, and two replicas that ask
            each other at once cannot swap states (one waits for the other). Returns the step loaded, or None."""
            with self.state_lock:
                self._loaded_epoch, self._loading = None, True
                try:
                    super().load_state_from_peers(**kwargs)
                finally:
                    self._loading = False
                return self._loaded_epoch

        def _update_scheduler(self):
            if self._loading:  # the base class's last call in a successful load
                self._loaded_epoch = self.local_epoch
            super()._update_scheduler()

        def step(self, *args, **kwargs):
            with self.state_lock if kwargs.get("increment_epoch") else contextlib.nullcontext():
                return super().step(*args, **kwargs)

    class _Optimizer(hivemind.Optimizer):
        used_local_gradients = False

        def _make_progress_tracker(self, target_batch_size: int, **kwargs):
            return BatchTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                                client_mode=self.client_mode, status_loglevel=self.status_loglevel, start=True,
                                **kwargs)

        def _make_state_averager(self, **kwargs):
            # hivemind.Optimizer._make_state_averager's arguments, with the consistent class.
            return ConsistentStateAverager(
                dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
                allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
                offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
                status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
                client_mode=self.client_mode, auxiliary=self.auxiliary, start=True, **kwargs)

        def _load_local_gradients_into_optimizer(self):
            self.used_local_gradients = True
            super()._load_local_gradients_into_optimizer()

    return _Optimizer


class HivemindStageOptimizer:
    """hivemind.Optimizer for one stage. Every method but the constructor runs on the peer's compute thread
    (``maybe_step`` may hold it for the all-reduce; never the event loop). It uses a few of hivemind
    1.1.12's private Optimizer methods to split accumulation from the global step (pinned version)."""

    def __init__(self, stage: Stage, run: RunConfig, *, dht, run_id: str, config: AveragingConfig,
                 private_key=None):
        self.stage, self.run, self.config = stage, run, config
        self.params = list(stage.parameters())
        self._later = LaterBatches()
        self.step_pause_s = 0.0  # how long global steps hold the compute thread: quick to rise, slow to fall
        groups = adamw_param_groups(stage, run.weight_decay)
        # adamw_param_groups keeps parameters in stage order within each group; hivemind averages in the
        # optimizer's order, so map stage order -> position for gradient reads.
        self._order = [p for g in groups for p in g["params"]]
        self._partial = PartialResults.install()  # before hivemind forks its averager processes
        with _keep_sigint_handler():
            self.opt = self._build(groups, dht, run_id, private_key)
        self.opt.grad_averager.step_key = lambda: epoch_group_bits(self.epoch)

        # hivemind creates Adam's moments with one virtual step on zero gradients. At lr 0 it moved nothing
        # (no decay either); undo its step count, or every later step's bias correction would be off by one.
        for param_state in self.opt.opt.state.values():
            if "step" in param_state:
                param_state["step"] = torch.zeros_like(torch.as_tensor(param_state["step"]))

    def _build(self, groups, dht, run_id: str, private_key):
        from hivemind.utils.crypto import RSAPrivateKey

        run, config = self.run, self.config
        # hivemind advises a request timeout below the matchmaking time (else matchmaking can deadlock).
        request_timeout = min(5.0, config.matchmaking_s / 2)
        return _optimizer_class()(
            dht=dht, run_id=stage_run_id(run_id, self.stage.index), target_batch_size=run.target_batch_size,
            params=groups, optimizer=lambda params: build_stage_optimizer(params, run, lr=0.0),
            matchmaking_time=config.matchmaking_s, averaging_timeout=config.averaging_timeout_s,
            # hivemind's default waits one matchmaking time for each chunk: a groupmate busy computing for longer
            # would be dropped and the replicas would average different partial results.
            next_chunk_timeout=config.chunk_timeout_s,
            load_state_timeout=config.load_state_timeout_s, offload_optimizer=False, delay_optimizer_step=False,
            delay_grad_averaging=False, use_local_updates=False,
            # Replicas start equal (same seed or a downloaded state) and apply the same averaged gradients, so
            # they stay equal without averaging parameters; newcomers download the state instead.
            average_state_every=2 ** 31, grad_compression=_compression(config.grad_compression),
            grad_averager_factory=_sample_sum_averager_factory(request_timeout),
            tracker_opts=dict(private_key=private_key or RSAPrivateKey(), min_refresh_period=0.2, default_refresh_period=0.5),
            averager_opts=dict(request_timeout=request_timeout), verbose=False,
        )

    @property
    def epoch(self) -> int:
        return self.opt.local_epoch

    @property
    def local_samples(self) -> int:
        return self.opt.grad_averager.local_samples_accumulated

    def accumulate(self, grads, num_samples, batch_step=None):
        """Add one microbatch toward step ``batch_step``: now if that is the stage's current step (or an
        earlier one: a late microbatch joins the current batch), else aside until the stage gets there.
        Each replica reports only the current step's samples, so the stage's count reaches the target
        exactly when the trainer's global batch is in, and the step averages exactly that batch.

        Never blocks for the all-reduce (``maybe_step`` takes the step once the group is ready), so a
        commit stays cheap. Returns True if the parameters changed (a replica that fell behind reloads)."""
        if batch_step is not None and batch_step > self.epoch:
            self._later.add(batch_step, self.epoch, grads, num_samples)
            if batch_step >= self.epoch + self._later.max_ahead and self.opt.tracker.global_progress.samples_accumulated:
                # The trainer is that many batches further: whatever of this one is still missing is not coming
                # (its trainer restarted, a replica holding part of it died). Step on what the stage has.
                self.opt.tracker.batch_closed = True
            return False
        return self._add(grads, num_samples)

    def _add(self, grads, num_samples: int) -> bool:
        """hivemind.Optimizer.step() up to, not including, the global step: accumulate, report progress, and
        schedule the all-reduce group ahead of the batch's end. (A replica that fell behind catches up in
        ``maybe_step``.)"""
        opt = self.opt
        for p, g in zip(self.params, grads):
            p.grad = g if g is not None else torch.zeros_like(p)
        opt._check_and_accumulate_gradients(num_samples, None)
        for p in self.params:
            p.grad = None
        if opt.tracker.global_progress.num_peers > 1:
            opt._maybe_schedule_gradient_averaging()
        return False

    def _catch_up(self) -> None:
        """After a step: count the microbatches kept aside for the step the stage has now reached."""
        while (due := self._later.pop_due(self.epoch)) is not None:
            self._add(*due)

    def maybe_step(self) -> bool:
        """Take the stage's optimizer step if its global batch is in and the all-reduce group has formed
        (called every ``step_check_s``; cheap when not). Waiting for the group happens in hivemind's
        averager process, not here, so compute goes on meanwhile; only the all-reduce and the update
        hold the compute thread. Returns True if the parameters changed."""
        from hivemind.averaging.control import AveragingStage

        opt, tracker = self.opt, self.opt.tracker
        if tracker.global_epoch <= self.epoch and tracker.global_progress.samples_accumulated == 0:
            return False  # nothing to average
        if not tracker.ready_to_update_epoch:
            if tracker.global_progress.num_peers > 1:
                opt._maybe_schedule_gradient_averaging()
            return False
        control = opt.scheduled_grads
        alone = tracker.global_progress.num_peers <= 1
        if not alone and (control is None or control.done()):
            # The batch filled before any group was scheduled.
            opt.scheduled_grads = control = opt.grad_averager.schedule_step(timeout=opt.averaging_timeout)
        live = control is not None and not control.done()
        forming = live and control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
        if alone and forming:  # its last peer left: step alone rather than wait averaging_timeout_s for a group
            control.cancel()
            opt.scheduled_grads, live, forming = None, False, False
        grouped = live and not forming
        if tracker.global_epoch > self.epoch and not grouped:
            # A peer already stepped past this replica's step and this replica is in no group: groups only join
            # replicas at the same step, and that step's group could not complete without this replica's part, so
            # it ran without it (it joined mid-step, or its peers' group assembled before it looked for one).
            # Take their state now, in time to look for the next step's group.
            logger.warning("stage %d replica is behind its peers (step %d < %d): loading their state",
                           self.stage.index, self.epoch, tracker.global_epoch)
            self._load_from_peers(tracker.global_epoch)
            self._catch_up()
            return True
        if forming:
            # Still looking for groupmates (hivemind assembles the group matchmaking_s after the first of them started
            # looking). Never wait for it on the compute thread: a group that forms without this replica steps
            # without it, and the check above then loads the peers' state (a missed group costs this replica's
            # samples of the batch, never a stalled stage or a replica out of step).
            return False
        self._global_step()
        self._catch_up()
        return True

    def _global_step(self) -> None:
        before = self.epoch
        _set_lr(opt_inner := self.opt.opt, self.run, before)
        self.opt.used_local_gradients = False
        skipped = opt_inner.skipped_steps
        partial = self._partial.count.value
        t0 = time.perf_counter()
        self.opt._update_global_epoch(None)
        self.opt.tracker.batch_closed = False
        took = time.perf_counter() - t0
        self.step_pause_s = max(took, 0.8 * self.step_pause_s + 0.2 * took)
        why = ("skipped its step" if opt_inner.skipped_steps > skipped
               else "stepped without its peers' gradients" if self.opt.used_local_gradients
               else "received part of the all-reduce only" if self._partial.count.value > partial else None)
        if why and self.opt.tracker.global_progress.num_peers > 1:
            # This replica missed the stage's all-reduce and stepped on its own gradients, got only part of the
            # averaged gradient (a groupmate's part timed out: it used its own values there), or skipped the step
            # (a non-finite average): its parameters now differ from its peers'. Take theirs rather than carry (and
            # later average) a private state.
            logger.warning("stage %d %s at step %d: reloading the stage's state from its peers", self.stage.index,
                           why, before)
            self._load_from_peers(self.epoch, doubtful=True)
        _set_lr(opt_inner, self.run, self.epoch)

    def sync_with_peers(self, peers_step: int = 0) -> bool:
        """Download parameters and optimizer state from the stage's peers if they are ahead of us (a
        newcomer, or a restarted peer whose checkpoint is older). ``peers_step`` is the highest step the
        stage's peers announce in the swarm's records: the tracker's first readings may predate them, so wait
        (up to ``load_state_timeout_s``) until it sees that step. Returns True if state was loaded; raises
        RuntimeError if the peers are ahead and their averaging is not visible (serving stale parameters would
        feed wrong gradients into the stage's average)."""
        tracker = self.opt.tracker
        deadline = time.monotonic() + self.config.load_state_timeout_s
        # The tracker reads the stage's progress from the DHT in the background: wait for its first reading.
        tracker.fetched_global_progress_this_epoch.wait(timeout=self.config.load_state_timeout_s)
        while tracker.global_epoch < peers_step and time.monotonic() < deadline:
            time.sleep(0.2)  # the tracker refreshes every default_refresh_period; there is no event per refresh
        if tracker.global_progress.num_peers == 0 or tracker.global_epoch <= self.epoch:
            if peers_step > self.epoch:
                raise RuntimeError(f"stage {self.stage.index}'s peers announce step {peers_step} but their "
                                   f"averaging state was not visible within {self.config.load_state_timeout_s:.0f}s; "
                                   f"check that they run with --average and this peer can reach them, then restart")
            return False
        self._load_from_peers(max(peers_step, tracker.global_epoch))
        return True

    def _load_from_peers(self, want_step: int, *, doubtful: bool = False) -> None:
        """Download parameters and optimizer state from the stage's most advanced peer until this replica holds a
        state of step ``want_step`` or later (retrying up to ``load_state_timeout_s``; still behind after that, the
        next step check tries again). ``doubtful``: this replica's own state of its step is known to be off (it
        ranks below its peers as a donor meanwhile).

        Like hivemind's ``Optimizer.load_state_from_peers`` but without its "catching up", which labels a state one
        step behind the stage with the stage's step although its parameters are the older step's (the replica would
        then carry that difference to the end of the run)."""
        from hivemind.averaging.control import AveragingStage

        opt, averager = self.opt, self.opt.state_averager
        control = opt.scheduled_grads
        if control is not None and not control.done():
            if control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
                control.cancel()  # no group counts on us yet (waiting for one could take averaging_timeout_s)
            else:
                opt._tag_along_with_zero_weight(control)  # a group counts on us: take part with weight 0
            opt.scheduled_grads = None
        if doubtful:
            averager.state_sharing_priority = self.epoch - 0.5
        deadline = time.monotonic() + self.config.load_state_timeout_s
        with opt.tracker.pause_updates():
            while True:
                loaded = averager.load_state_from_peers(timeout=max(1.0, deadline - time.monotonic()))
                if (loaded is not None and loaded >= want_step) or time.monotonic() >= deadline:
                    break
                # The peer we reached is at an older step (it steps next, or the one ahead is busy), or none answered
                # (two doubtful replicas asking each other at once): ask again after a random pause, so one goes first.
                time.sleep(self.config.step_check_s * random.uniform(2, 8))
            opt.tracker.report_local_progress(self.epoch, samples_accumulated=0)
            self._announce_step()
            opt.grad_averager.reset_accumulated_grads_()
        if self.epoch < want_step:
            logger.warning("stage %d: downloaded the state of step %d, its peers are at step %d", self.stage.index,
                           self.epoch, want_step)

    def grad_sums(self):
        by_param = {id(p): acc for p, acc in zip(self._order, self.opt.grad_averager._grad_accumulators())}
        return [by_param[id(p)].detach().clone() for p in self.params]

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.opt.state_averager.local_epoch = int(state["epoch"])
        self.opt.tracker.report_local_progress(self.epoch, 0)
        self._announce_step()

    def _announce_step(self) -> None:
        """Peers downloading the stage's state prefer the replica with the highest priority: its step."""
        self.opt.state_averager.state_sharing_priority = self.opt.grad_averager.state_sharing_priority = self.epoch

    def shutdown(self) -> None:
        self.opt.shutdown()
