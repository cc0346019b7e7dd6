"""Claims: how the peers of one stage agree that at most one of them leaves it per period.

A peer that decides to move writes a claim under ``claim_key(from_stage, period_index)`` (subkey:
its own id) and re-reads the key shortly after. Every peer ranks the claimers of a key the same way
(:func:`claim_rank`, a hash that does not depend on the process), so when several claimed at once
they all agree on the single winner without another round trip; the others stay.

Python's built-in ``hash`` of a string is salted per process, so it would give every peer a
different winner: the rank is a BLAKE2b digest instead.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection

__all__ = ["claim_key", "claim_rank", "claim_winner", "is_my_turn", "period_index"]


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


def is_my_turn(claimers: Collection[str] | str, me: str, period_index: int) -> bool:
    """After writing its claim and re-reading the key: may ``me`` leave its stage this period?

    True only when ``me`` is among ``claimers`` and wins the ranking. A bare id string is read as
    one claimer. A peer whose claim is not visible yet gets False and stays: staying is always safe.
    """
    found = frozenset((claimers,)) if isinstance(claimers, str) else frozenset(claimers)
    return me in found and claim_winner(found, period_index) == me
