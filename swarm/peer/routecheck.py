"""Which addresses a push call may make this peer dial: only peers the run announces.

A push call's route names the next stage's candidates (endpoint, peer id, certificate) and this peer dials them. A
caller that could name any address would have every peer it reaches connect wherever it says: to hosts of the peer's
own network that the caller cannot reach, port by port. So a candidate is dialed only when a signed record of that
stage, read from the DHT by this peer, announces the same peer id at the same endpoint with the same certificate.

The records are kept per stage and re-read on a miss, at most once per :data:`REREAD_S` per stage (misses at the same
time share one read), up to :data:`MISS_READS` times before a candidate is refused (a peer's view of the DHT can lag
the trainer's by a moment); a peer seen in a record stays known for :data:`KNOWN_FOR_S` after it was last seen, so a
trainer's view a few heartbeats old (a peer that just died, whose record expired) still gets a hop that fails as a
dead peer does, not a refusal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from swarm.discovery.records import StageRecord

logger = logging.getLogger(__name__)

# seconds a peer stays known after the last record that announced it; and between two reads of a stage's records
KNOWN_FOR_S = 120.0
REREAD_S = 1.0
MISS_READS = 3  # reads of a stage's records before a candidate not in them is refused


@dataclass(frozen=True)
class _Known:
    endpoint: str
    tls_cert: str
    seen_s: float


class RouteCheck:
    """``read(stage)`` returns the stage's live records by peer id (``RunDirectory.stage_records``)."""

    def __init__(
        self,
        read: Callable[[int], Awaitable[dict[str, StageRecord]]],
        *,
        config_hash: str,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self._read, self._config_hash, self._clock, self._sleep = read, config_hash, clock, sleep
        self._known: dict[int, dict[str, _Known]] = {}
        self._read_at: dict[int, float] = {}
        self._reading: dict[int, asyncio.Future] = {}

    async def refusal(self, stage: int, peer_id: str, endpoint: str, tls_cert: str) -> str | None:
        """Why this peer must not dial the candidate, or None when a record of ``stage`` announces it so."""
        if self._matches(stage, peer_id, endpoint, tls_cert):
            return None
        # A peer's view of the DHT can lag the trainer's by a moment (a peer just announced): read again, up to
        # MISS_READS times at REREAD_S apart, before refusing.
        for _ in range(MISS_READS):
            wait_s = self._read_at.get(stage, -REREAD_S) + REREAD_S - self._clock()
            if wait_s > 0:
                await self._sleep(wait_s)
            await self._reread(stage)
            if self._matches(stage, peer_id, endpoint, tls_cert):
                return None
        known = self._known.get(stage, {}).get(peer_id)
        if known is None:
            return (
                f"no record of stage {stage} in the run announces peer {peer_id}: this peer dials only peers the "
                f"run announces (refresh the route from the DHT)"
            )
        return (
            f"peer {peer_id} of stage {stage} announces {known.endpoint} and another certificate than the route "
            f"names ({endpoint}): this peer dials only what the peer's signed record says"
            if known.endpoint == endpoint
            else f"peer {peer_id} of stage {stage} announces endpoint {known.endpoint}, not {endpoint}: this peer "
            f"dials only what the peer's signed record says"
        )

    def _matches(self, stage: int, peer_id: str, endpoint: str, tls_cert: str) -> bool:
        known = self._known.get(stage, {}).get(peer_id)
        return (
            known is not None
            and self._clock() - known.seen_s <= KNOWN_FOR_S
            and known.endpoint == endpoint
            and known.tls_cert == tls_cert
        )

    async def _reread(self, stage: int) -> None:
        pending = self._reading.get(stage)
        if pending is None:
            pending = self._reading[stage] = asyncio.ensure_future(self._read_stage(stage))
            pending.add_done_callback(lambda _: self._reading.pop(stage, None))
        await asyncio.shield(pending)

    async def _read_stage(self, stage: int) -> None:
        self._read_at[stage] = self._clock()
        try:
            records = await self._read(stage)
        except Exception as e:
            # the DHT did not answer: what is known stays, nothing new is admitted
            logger.warning("reading stage %d's records to check a push route failed: %s", stage, e)
            return
        now = self._clock()
        known = {
            pid: k for pid, k in self._known.get(stage, {}).items() if now - k.seen_s <= KNOWN_FOR_S
        }
        for pid, record in records.items():
            if record.config_hash == self._config_hash:
                known[pid] = _Known(record.endpoint, record.tls_cert, now)
        self._known[stage] = known
