"""The peer's compute queue, measured in seconds, and the load shedding that keeps it worth running.

Every call that needs the compute thread passes through :meth:`WorkQueue.admit` with its deadline and the
seconds its work should take (from the executor's measured per-sample times). The queue sums the predicted
seconds of the calls admitted and not finished; :func:`~swarm.routing.shedding.shed_reason` (the rule the
simulator runs too) decides from it whether the call may queue. When the call's turn on the compute thread
comes, the work is skipped if the deadline passed meanwhile (the prediction was short): a reply nobody waits
for is compute taken from calls that can still count. Either refusal raises
:class:`~swarm.errors.DeadlineUnmet` (RESOURCE_EXHAUSTED), which trainers answer by trying another peer at
once, without a ban.

Predictions come from the executor's per-sample times, which its calibration seeds with the fastest of a few
runs and which leave out what a busy machine adds around the compute. So the queue also times each job it
guards on the compute thread and scales every prediction by an EMA of (measured / predicted), never below 1:
a peer that under-predicts would admit calls that then miss their deadlines, the waste shedding exists to
avoid. A job stretched by a stall (a replica frozen mid-job, a swapped-out process) raises that ratio up to its cap,
and a peer whose every prediction then ends past its callers' deadlines admits nothing, so measures nothing that
would lower it: the ratio relaxes toward 1 while nothing is measured (half of the excess every
``_CORRECTION_HALF_LIFE_S``), and the next jobs admitted measure it again. (The soak's thawed replica refused every
call for 10 minutes, 895 of them, on a correction of 10.) Bookkeeping runs on the event loop; the guard
runs on the compute thread and writes only that ratio and when it measured it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from swarm.errors import DeadlineUnmet
from swarm.routing.shedding import ShedReason, shed_reason
from swarm.routing.stats import ema

__all__ = ["WorkQueue"]

# Weight of the newest job in the correction EMA, and the correction's cap (a stall, e.g. a swapped-out process,
# must not make the peer refuse everything for long).
_ALPHA = 0.3
_MAX_CORRECTION = 10.0
# Seconds without a measured job in which the correction's excess over 1 halves.
_CORRECTION_HALF_LIFE_S = 5.0


class WorkQueue:
    """``max_queue_wait_s``: bound of the queue ahead of a new call, seconds (0 = unbounded); ``enabled``
    False admits everything (the peer then computes expired work, as before load shedding)."""

    def __init__(
        self,
        *,
        max_queue_wait_s: float,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_queue_wait_s = max_queue_wait_s
        self.enabled = enabled
        self._clock = clock
        self.queued_s = 0.0  # predicted compute seconds of the calls admitted and not finished
        self.shed = {reason: 0 for reason in ShedReason}  # calls refused, by reason
        # EMA of a job's measured compute-thread seconds over its prediction (>= 1) as of ``_measured_at``: scales
        # predictions (see ``correction``); it does not relax while a job runs (``_running``)
        self._correction, self._measured_at, self._running = 1.0, clock(), False

    @property
    def correction(self) -> float:
        """What predictions are scaled by now: the measured ratio, relaxed toward 1 for the time since it was
        last measured."""
        if self._running:
            return self._correction
        idle_s = max(0.0, self._clock() - self._measured_at)
        return 1.0 + (self._correction - 1.0) * 0.5 ** (idle_s / _CORRECTION_HALF_LIFE_S)

    @property
    def shed_total(self) -> int:
        return sum(self.shed.values())

    @contextlib.contextmanager
    def admit(self, *, deadline_s: float | None, cost_s: float) -> Iterator[Callable]:
        """Admit a call whose work takes about ``cost_s`` seconds and whose caller waits until ``deadline_s``
        (this queue's clock; None: no deadline), or raise :class:`DeadlineUnmet`. Yields ``guard(fn)``: the
        function to run on the compute thread instead of ``fn``, which refuses to start after the deadline."""
        predicted_s = max(0.0, cost_s)
        cost_s = predicted_s * self.correction
        if self.enabled:
            reason = shed_reason(
                now_s=self._clock(),
                deadline_s=deadline_s,
                queue_wait_s=self.queued_s,
                cost_s=cost_s,
                max_queue_wait_s=self.max_queue_wait_s,
            )
            if reason is not None:
                raise self._refuse(reason, deadline_s, cost_s)
        self.queued_s += cost_s
        try:
            yield self._guard(deadline_s if self.enabled else None, predicted_s)
        except DeadlineUnmet:
            self.shed[ShedReason.EXPIRED] += 1
            raise
        finally:
            self.queued_s = max(0.0, self.queued_s - cost_s)

    def _guard(self, deadline_s: float | None, predicted_s: float) -> Callable:
        clock = self._clock

        def guard(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args, **kwargs):
                started = clock()
                if deadline_s is not None and started >= deadline_s:
                    raise DeadlineUnmet(
                        f"the caller's deadline passed {started - deadline_s:.2f}s before this call's turn on "
                        "the compute thread; the work was not started: retry at another peer of the stage"
                    )
                self._correction, self._running = self.correction, True
                try:
                    result = fn(*args, **kwargs)
                finally:
                    self._running, self._measured_at = False, clock()
                if predicted_s > 0:
                    ratio = max(1.0, (self._measured_at - started) / predicted_s)
                    self._correction = min(_MAX_CORRECTION, ema(self._correction, ratio, _ALPHA))
                return result

            return run

        return guard

    def _refuse(self, reason: ShedReason, deadline_s: float | None, cost_s: float) -> DeadlineUnmet:
        self.shed[reason] += 1
        left_s = None if deadline_s is None else deadline_s - self._clock()
        if reason is ShedReason.QUEUE_FULL:
            why = (
                f"{self.queued_s:.2f}s of compute are queued here, more than --max-queue-wait-s="
                f"{self.max_queue_wait_s:g}"
            )
        elif reason is ShedReason.EXPIRED:
            why = f"the caller's deadline passed {-left_s:.2f}s before the work could start"
        else:
            why = (
                f"{self.queued_s:.2f}s of compute queued here plus this call's {cost_s:.2f}s end after the "
                f"caller's deadline ({left_s:.2f}s from now)"
            )
        return DeadlineUnmet(f"work not started: {why}; retry at another peer of the stage")
