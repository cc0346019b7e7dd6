"""Ban book: consecutive failures and ban expiry per peer id, kept apart from discovery.

Why a separate map: discovery replaces a stage's peer set on every refresh, and a failing peer
keeps re-announcing itself. If bans lived with the per-stage stats (as in SWARM's reference code),
a re-announcement would create fresh stats and lift the ban. Here a ban outlives the peer's
disappearance from discovery and is only lifted by time (or a success after it expires).
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.routing.config import RoutingConfig

__all__ = ["BanBook", "BanRecord"]


@dataclass(kw_only=True)
class BanRecord:
    """Failure history of one peer id."""

    # Consecutive failures since the last success.
    failures: int
    # The peer may not be chosen while now < banned_until_s (seconds, caller's clock).
    banned_until_s: float


class BanBook:
    """Bounded map peer id -> :class:`BanRecord`.

    Holds at most ``config.max_ban_records`` ids. On overflow it forgets the record whose ban ended
    first (an expired one when there is any), so the peers banned longest are remembered longest.
    A record is dropped when a success lands after its ban ended, so healthy peers have none.
    """

    def __init__(self, config: RoutingConfig) -> None:
        self._config = config
        self._records: dict[str, BanRecord] = {}

    def __len__(self) -> int:
        return len(self._records)

    def record_failure(self, peer_id: str, now: float) -> float:
        """Count one more consecutive failure of ``peer_id`` at time ``now`` (seconds) and ban it
        for ``min(ban_max_s, ban_base_s * 2 ** (failures - 1))`` seconds from ``now``.

        A failure reported while the peer is already banned is not counted: it comes from a
        request sent before the ban (a peer that crashes with eight requests in flight fails all
        eight), and counting each would turn one incident into a 2**7-times longer ban.
        Returns the end of the peer's ban, seconds.
        """
        record = self._records.get(peer_id)
        if record is not None and record.banned_until_s > now:
            return record.banned_until_s
        if record is None:
            record = BanRecord(failures=0, banned_until_s=now)
            self._records[peer_id] = record
        record.failures += 1
        until = now + self._config.ban_duration_s(record.failures)
        record.banned_until_s = until
        self._evict_overflow(keep=peer_id)
        return record.banned_until_s

    def record_success(self, peer_id: str, now: float) -> None:
        """Reset ``peer_id``'s failure count at time ``now`` (seconds).

        A success that lands while the peer is banned (its request started before the failure
        that banned it) does not lift the ban: only time does. The record is dropped once the
        ban has ended, so healthy peers cost no memory here.
        """
        record = self._records.get(peer_id)
        if record is None:
            return
        record.failures = 0
        if record.banned_until_s <= now:
            del self._records[peer_id]

    def banned_until_s(self, peer_id: str, now: float) -> float | None:
        """End of ``peer_id``'s ban in seconds, or ``None`` when it is not banned at ``now``."""
        record = self._records.get(peer_id)
        if record is None or record.banned_until_s <= now:
            return None
        return record.banned_until_s

    def failures(self, peer_id: str) -> int:
        """Consecutive failures of ``peer_id`` since its last success (0 when unknown)."""
        record = self._records.get(peer_id)
        return 0 if record is None else record.failures

    def _evict_overflow(self, *, keep: str) -> None:
        # O(records), only when full: the simulator's churn must not grow memory without bound.
        # ``keep`` is the peer that just failed; forgetting it would lift the ban just imposed.
        while len(self._records) > self._config.max_ban_records:
            victim = min(
                (pid for pid in self._records if pid != keep),
                key=lambda pid: self._records[pid].banned_until_s,
            )
            del self._records[victim]
