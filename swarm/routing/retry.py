"""The retry rule of one stage request, shared by the trainer and the simulator.

Pure code: no I/O; time comes in as ``now``, randomness as a ``random.Random``. The trainer's one retry
helper (``Pipeline._call``) and the simulator's (``_Simulation._send``) both drive a :class:`StageRequest`::

    request = StageRequest(router, stage, preferred=forward_peer)
    while True:
        try:
            peer = request.choose(now, rng)
        except NoPeersAvailable as error:
            sleep until wake_at(error, now, wait_s=...), then choose again
        router.on_start(stage, peer, now)
        try:
            result = await call(peer, timeout=router.deadline_s(stage, peer, size))
        except SwarmError as error:
            if request.failed(peer, error, now) is Failure.GIVE_UP:
                raise                                # RetriesExhausted is raised by failed() when spent
            continue
        router.on_success(stage, peer, size, elapsed_s, now)
        break

The rule:

* **Choice.** The preferred peer (for backward, the one that ran the forward: it holds the inputs, so no
  recompute) whenever the caller still knows it, it is not banned and it has not failed this request;
  else :meth:`Router.choose` without the peers that failed this request. When that leaves no one because
  every peer already failed it once, choose again without exclusions (bans still apply), keeping the
  budget: the attempts stay bounded (a fresh budget there would retry a small stage forever).
* **Failure.** A request the peer rejected as invalid (``retry_elsewhere`` false) fails the same way
  anywhere: give up, no ban. A peer that shed the work (``DeadlineUnmet``: busy, not faulty) is not banned
  and its failure count is untouched; the request goes to another peer, or, when every eligible peer
  already failed it, back to one that shed it only ``shed_hold_s`` after that refusal (its queue drains
  meanwhile). A peer that is draining or moved (``PeerDraining``, ``WrongPeer``) is alive and honest: no
  ban (it may come back), the caller stops routing new work there. Anything else bans the peer with
  back-off. Every failure but the first kind counts against the budget.
* **Waiting.** With no eligible peer, wake at the earliest ban end, or after the caller's wait if that
  comes first (:func:`wake_at`).
"""

from __future__ import annotations

import enum
import random

from swarm.errors import DeadlineUnmet, PeerDraining, SwarmError, WrongPeer
from swarm.routing.errors import NoPeersAvailable
from swarm.routing.router import Router

__all__ = ["Failure", "StageRequest", "failure_kind", "wake_at"]


class Failure(enum.Enum):
    """What a failed attempt says about the peer, and so what the request does next."""

    GIVE_UP = "give up"  # the request itself is wrong: any peer would fail it; no ban, no retry
    AVOID = (
        "avoid"  # the peer is alive but leaving or moved: no ban; route new work elsewhere; retry
    )
    SHED = "shed"  # the peer is healthy but too busy to meet the deadline: no ban; retry elsewhere
    BAN = "ban"  # the peer failed (transport, deadline, crash, overload): ban with back-off; retry


def failure_kind(error: BaseException | None) -> Failure:
    """Classify a failed attempt; ``None`` (no error object, e.g. in the simulator) counts as a transport
    failure."""
    if isinstance(error, SwarmError) and not error.retry_elsewhere:
        return Failure.GIVE_UP
    if isinstance(error, DeadlineUnmet):
        return Failure.SHED
    if isinstance(error, (PeerDraining, WrongPeer)):
        return Failure.AVOID
    return Failure.BAN


def wake_at(
    error: NoPeersAvailable, now: float, *, wait_s: float, min_wait_s: float = 1e-3
) -> float:
    """When to choose again after ``error``: the earliest ban end, or ``now + wait_s`` if sooner (peers
    may appear meanwhile), and never sooner than ``now + min_wait_s`` (seconds, caller's clock)."""
    delay = wait_s if error.retry_at_s is None else min(wait_s, error.retry_at_s - now)
    return now + max(min_wait_s, delay)


class StageRequest:
    """One request to ``stage`` through its retries: which peer to try next, what a failure does, and the
    finite budget (see the module docstring for the rule)."""

    def __init__(self, router: Router, stage: int, *, preferred: str | None = None) -> None:
        self.router = router
        self.stage = stage
        self.preferred = preferred
        self.budget = router.retry_budget(stage)
        self._shed_at: dict[str, float] = {}  # peers that refused this request as busy, and when

    @property
    def failed_peers(self) -> frozenset[str]:
        return self.budget.failed_peers

    def choose(self, now: float, rng: random.Random, *, preferred_known: bool = True) -> str:
        """The peer for the next attempt. ``preferred_known``: the caller's peer list still has the preferred
        peer. Raises :class:`NoPeersAvailable` when no peer may be tried now (see :func:`wake_at`)."""
        preferred = self.preferred
        if (
            preferred is not None
            and preferred_known
            and preferred not in self.budget.failed_peers
            and self.router.banned_until_s(preferred, now) is None
        ):
            return preferred
        try:
            return self.router.choose(self.stage, now, rng, exclude=self.budget.failed_peers)
        except NoPeersAvailable as error:
            if not error.num_excluded:
                raise
        # Every eligible peer already failed this request once: try them again (bans still apply), but
        # not a peer that refused it as busy until its queue had time to drain.
        peer = self.router.choose(self.stage, now, rng)
        shed_at = self._shed_at.get(peer)
        if shed_at is not None and now < shed_at + self.router.config.shed_hold_s:
            raise NoPeersAvailable(
                self.stage,
                num_known=len(self.router.peers(self.stage)),
                num_excluded=len(self.budget.failed_peers),
                retry_at_s=min(self._shed_at.values()) + self.router.config.shed_hold_s,
            )
        return peer

    def failed(self, peer: str, error: BaseException | None, now: float) -> Failure:
        """Apply the failed attempt at ``peer`` to the router (ban, or just end the call) and to the budget.
        Returns its :class:`Failure` kind; raises :class:`RetriesExhausted` (chained from ``error``) when
        that was the budget's last attempt. On ``GIVE_UP`` the caller raises ``error`` itself."""
        kind = failure_kind(error)
        if kind is Failure.BAN:
            self.router.on_failure(self.stage, peer, now)
        else:
            self.router.on_cancel(self.stage, peer, now)
        if kind is Failure.SHED:
            self._shed_at[peer] = now
        if kind is not Failure.GIVE_UP:
            self.budget.record_failure(peer, error)
        return kind
