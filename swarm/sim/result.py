"""What a simulated run reports: time series of throughput and placement, moves, failures."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from swarm.sim.config import SimConfig

__all__ = ["Move", "SimResult", "format_table"]


@dataclass(frozen=True, kw_only=True)
class Move:
    """A peer leaving ``from_stage`` for ``to_stage`` at simulated time ``time_s``."""

    time_s: float
    peer_id: str
    from_stage: int
    to_stage: int


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Outcome of :func:`~swarm.sim.engine.simulate`. Sample ``i`` covers
    ``(times_s[i] - sample_period_s, times_s[i]]``."""

    config: SimConfig
    # End of each sample window, seconds.
    times_s: tuple[float, ...]
    # Samples that finished forward + backward through every stage in the window, per second.
    throughput: tuple[float, ...]
    # Serving peers of each stage at the end of each window.
    peers_per_stage: tuple[tuple[int, ...], ...]
    # Sum of the serving peers' speeds per stage (samples/s) at the end of each window.
    capacity_per_stage: tuple[tuple[float, ...], ...]
    moves: tuple[Move, ...]
    microbatches_started: int
    microbatches_completed: int
    # Microbatches still in flight when the run ended (none is ever dropped).
    microbatches_in_flight: int
    # Start time of the oldest microbatch still in flight at the end, seconds; None when none.
    oldest_in_flight_started_s: float | None
    # Requests that failed (dead peer, timeout) and were retried.
    hop_failures: int
    # Requests a peer refused because their deadline could not be met (load shedding); among hop_failures.
    requests_shed: int
    # Compute seconds each stage's peers were given (busy time), and of those the seconds spent on requests
    # whose reply came after the caller's deadline (wasted).
    busy_s_per_stage: tuple[float, ...]
    late_s_per_stage: tuple[float, ...]
    # Backward requests that had to recompute the forward because its peer was gone.
    recomputes: int
    peers_arrived: int
    peers_died: int
    # Successful requests (forward and backward) served, per peer id.
    requests_by_peer: Mapping[str, int]
    # Events the loop processed (a cost measure independent of the machine).
    events: int

    @property
    def num_moves(self) -> int:
        return len(self.moves)

    def mean_throughput(self, start_s: float = 0.0, end_s: float = math.inf) -> float:
        """Mean of the throughput samples whose window ends in ``(start_s, end_s]``, samples/s."""
        values = [v for t, v in zip(self.times_s, self.throughput) if start_s < t <= end_s]
        return sum(values) / len(values) if values else 0.0


def format_table(results: Mapping[str, SimResult], every_s: float) -> str:
    """A markdown table: one row per ``every_s`` seconds, for each named run its mean throughput
    over the rows' interval and its serving peers per stage at the row's end."""
    names = list(results)
    header = ["t (s)"]
    for name in names:
        header += [f"{name}: samples/s", f"{name}: peers per stage"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    first = results[names[0]]
    end = first.times_s[-1] if first.times_s else 0.0
    t = every_s
    while t <= end + 1e-9:
        row = [f"{t:.0f}"]
        for name in names:
            result = results[name]
            row.append(f"{result.mean_throughput(t - every_s, t):.1f}")
            index = max(i for i, ts in enumerate(result.times_s) if ts <= t + 1e-9)
            row.append("/".join(str(n) for n in result.peers_per_stage[index]))
        lines.append("| " + " | ".join(row) + " |")
        t += every_s
    return "\n".join(lines)
