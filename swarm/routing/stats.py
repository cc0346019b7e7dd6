"""Per-peer measurements of one stage: throughput and latency EMAs, requests in flight."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PeerStats", "PeerSnapshot", "ema", "valid_announcement"]


def ema(previous: float | None, observation: float, alpha: float) -> float:
    """Exponential moving average; the first observation (``previous is None``) is taken as is."""
    if previous is None:
        return observation
    return (1.0 - alpha) * previous + alpha * observation


def valid_announcement(throughput: object) -> float | None:
    """An announced throughput (samples/s) usable as a prior, or ``None`` for "no claim".

    Announcements come from other machines: zero, negative, non-finite or non-numeric values are
    treated as absent rather than trusted or raised on.
    """
    if isinstance(throughput, bool) or not isinstance(throughput, (int, float)):
        return None
    if not math.isfinite(throughput) or throughput <= 0:
        return None
    return float(throughput)


@dataclass(kw_only=True)
class PeerStats:
    """Mutable measurements of one peer in one stage, owned by the router."""

    # Throughput the peer announced in discovery, samples/s; None when it made no usable claim.
    announced_throughput: float | None
    # Time the router first learned of the peer, seconds (caller's clock).
    added_at_s: float
    # EMA of size / elapsed over successful round trips, samples/s; None before the first.
    throughput_ema: float | None = None
    # EMA of the elapsed seconds of successful round trips; None before the first.
    latency_ema_s: float | None = None
    # Requests started (on_start) and not yet finished (success, failure or cancel).
    in_flight: int = 0
    # Successful round trips observed.
    num_successes: int = 0
    # EMA of the peer's compute seconds per unit of work (from its replies' compute_s); None before the first.
    compute_per_work_ema_s: float | None = None
    # Fewest seconds per unit of work a round trip spent outside the peer's compute (transfer, latency, its
    # queue): the smallest seen is the round trip without a queue; None before the first reported compute_s.
    overhead_per_work_s: float | None = None

    @property
    def measured(self) -> bool:
        return self.throughput_ema is not None

    @property
    def service_rate(self) -> float | None:
        """Units of work per second the peer serves when its queue is empty (its compute plus the transfer
        and latency of the fastest round trip seen), or None before a reply reported its compute time."""
        if self.compute_per_work_ema_s is None or self.overhead_per_work_s is None:
            return None
        return 1.0 / (self.compute_per_work_ema_s + self.overhead_per_work_s)

    def observe(
        self, *, size: float, elapsed_s: float, alpha: float, compute_s: float | None = None
    ) -> None:
        """Fold in one successful round trip of ``size`` samples that took ``elapsed_s`` seconds, of which
        the peer reported ``compute_s`` (> 0; None or 0: not reported) spent computing it.

        The first measurement replaces the announced prior outright: an announcement is a claim
        by the peer (possibly stale or false), a round trip is evidence.
        """
        self.throughput_ema = ema(self.throughput_ema, size / elapsed_s, alpha)
        self.latency_ema_s = ema(self.latency_ema_s, elapsed_s, alpha)
        self.num_successes += 1
        if compute_s is not None and math.isfinite(compute_s) and compute_s > 0:
            # A peer cannot compute longer than the round trip took: a larger claim is capped there.
            compute_s = min(compute_s, elapsed_s)
            self.compute_per_work_ema_s = ema(self.compute_per_work_ema_s, compute_s / size, alpha)
            overhead = (elapsed_s - compute_s) / size
            if self.overhead_per_work_s is None or overhead < self.overhead_per_work_s:
                self.overhead_per_work_s = overhead


@dataclass(frozen=True, kw_only=True)
class PeerSnapshot:
    """Read-only view of one peer for status pages, the simulator and tests."""

    peer_id: str
    stage: int
    # Rate used for routing, samples/s: the EMA once measured, else the prior (see Router).
    throughput: float
    measured: bool
    throughput_ema: float | None
    latency_ema_s: float | None
    in_flight: int
    num_successes: int
    failures: int
    # End of the current ban, seconds; None when not banned at the time of the query.
    banned_until_s: float | None
