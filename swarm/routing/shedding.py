"""Load shedding: whether a peer starts a call's work, given the caller's deadline and the peer's queue.

Pure code shared by the peer daemon (:mod:`swarm.peer.queue`) and the simulator, so both shed the same
work. A peer that computes a request whose caller already gave up spends its time on nothing while
the requests behind it wait and expire in turn: after a mass preemption the surviving peers of a
stage then deliver a fraction of their capacity (congestion collapse). The rule refuses such work at
once, with :class:`~swarm.errors.DeadlineUnmet`, so the caller retries at another peer right away
instead of waiting out its deadline, and the peer's time goes to calls that can still count.

Times are seconds on the peer's own clock (any clock used consistently); ``deadline_s`` is when the
caller stops waiting for the reply, ``None`` when the call carries no deadline.
"""

from __future__ import annotations

import enum
import math

__all__ = ["ShedReason", "shed_reason"]


class ShedReason(enum.Enum):
    """Why a peer refused to start a call's work (the label of its shed counter)."""

    EXPIRED = "expired"  # the caller's deadline had passed when the work would have started
    UNMEETABLE = "unmeetable"  # the queue ahead plus the work itself end after the deadline
    QUEUE_FULL = "queue_full"  # the queue ahead is longer than the peer's bound, in seconds


def shed_reason(
    *,
    now_s: float,
    deadline_s: float | None,
    queue_wait_s: float,
    cost_s: float,
    max_queue_wait_s: float = 0.0,
) -> ShedReason | None:
    """``None`` to start (or queue) the work now, else why to refuse it.

    ``queue_wait_s`` is the peer's estimate of the compute queued ahead of this call, ``cost_s`` its
    estimate of this call's own compute (0 when it has measured nothing yet: then only an expired
    deadline sheds), ``max_queue_wait_s`` the bound on the queue ahead (0 = unbounded). The order of
    the checks fixes the reason reported when several apply: expired, queue full, unmeetable.
    """
    for name, value in (("queue_wait_s", queue_wait_s), ("cost_s", cost_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0 seconds, got {value}")
    if deadline_s is not None and now_s >= deadline_s:
        return ShedReason.EXPIRED
    if max_queue_wait_s > 0 and queue_wait_s > max_queue_wait_s:
        return ShedReason.QUEUE_FULL
    if deadline_s is not None and now_s + queue_wait_s + cost_s > deadline_s:
        return ShedReason.UNMEETABLE
    return None
