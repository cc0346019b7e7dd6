"""Claims: how the peers of one stage agree that at most ``budget`` of them leave it per period.

A peer that decides to move writes a claim under ``claim_key(from_stage, period_index)`` (subkey:
its own id) and re-reads the key shortly after. Every peer ranks the claimers of a key the same way
(:func:`claim_rank`, a hash that does not depend on the process), so when more claimed at once than
the period's budget allows (their views differed) they all agree on which go without another round
trip: the ``budget`` lowest ranks; the others stay. The budget is the number of departures the
mover's plan counts for that stage (:attr:`~swarm.balance.policy.MoveDecision.budget`), so a stage
never loses more peers in one period than a plan asked of it.

Python's built-in ``hash`` of a string is salted per process, so it would give every peer a
different winner: the rank is a BLAKE2b digest instead.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection

__all__ = [
    "claim_key",
    "claim_rank",
    "claim_winner",
    "claim_winners",
    "is_my_turn",
    "period_index",
]


def period_index(now: float, period_s: float) -> int:
    """Index of the rebalancing period containing time ``now`` (seconds, a clock all peers share,
    e.g. the DHT time): ``floor(now / period_s)``."""
    if not math.isfinite(now):
        raise ValueError(f"now must be a finite time in seconds, got {now}")
    if not (math.isfinite(period_s) and period_s > 0):
        raise ValueError(f"period_s must be finite and > 0 seconds, got {period_s}")
    return math.floor(now / period_s)


def claim_key(stage: int, period_index: int) -> str:
    """DHT key (below the run's prefix, e.g. ``swarm/{run_id}/``) of the claims to leave ``stage``
    during ``period_index``. Claims are worth nothing after their period: store them with an
    expiration of about two periods."""
    if stage < 0:
        raise ValueError(f"stage must be >= 0, got {stage}")
    return f"rebalance/{stage}/{period_index}"


def claim_rank(peer_id: str, period_index: int) -> int:
    """Deterministic pseudo-random rank of ``peer_id`` in ``period_index``; lower wins.

    Mixing in the period rotates the winner between periods, so one peer id is not always first.
    """
    digest = hashlib.blake2b(f"{period_index}/{peer_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def claim_winner(claimers: Collection[str], period_index: int) -> str | None:
    """The claimer every peer agrees on: lowest :func:`claim_rank`, then lowest id; ``None`` if none."""
    if not claimers:
        return None
    return min(claimers, key=lambda peer: (claim_rank(peer, period_index), peer))


def is_my_turn(
    claimers: Collection[str] | str, me: str, period_index: int, budget: int = 1
) -> bool:
    """After writing its claim and re-reading the key: may ``me`` leave its stage this period?

    True only when ``me`` is among ``claimers`` and ranks among the first ``budget`` of them (by
    :func:`claim_rank`, then id). A bare id string is read as one claimer. A peer whose claim is not
    visible yet gets False and stays: staying is always safe. O(claimers).
    """
    found = frozenset((claimers,)) if isinstance(claimers, str) else frozenset(claimers)
    return me in found and me in claim_winners(found, period_index, budget)


def claim_winners(claimers: Collection[str], period_index: int, budget: int) -> frozenset[str]:
    """The ``budget`` claimers every peer agrees may leave (lowest :func:`claim_rank`, then id).
    O(claimers log claimers): compute it once per key when deciding for many claimers."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1 departure, got {budget}")
    ranked = sorted(claimers, key=lambda peer: (claim_rank(peer, period_index), peer))
    return frozenset(ranked[:budget])
