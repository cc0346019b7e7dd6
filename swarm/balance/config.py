"""Configuration of the rebalancing policy."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.schema import check_field_types

__all__ = ["RebalanceConfig"]


@dataclass(frozen=True, kw_only=True)
class RebalanceConfig:
    """Knobs of :func:`~swarm.balance.policy.decide_move`; ``__post_init__`` checks every field."""

    FLAG_TITLE = "rebalancing"

    # Seconds between two rebalancing decisions; also the length of one claim period.
    period_s: float = 60.0
    # Relative gain of the swarm throughput (min over stages) that rebalancing must be able to reach
    # before any peer moves, e.g. 0.1 = 10%; below it the swarm counts as balanced (noise, not need).
    min_gain: float = 0.2
    # Each move must raise the weaker of its two stages by at least this fraction of the throughput
    # the mover brings, in (0, 1]; refuses overshooting moves that would invite a move back.
    min_move_fraction: float = 0.5
    # Most of a stage's serving peers that may leave it in one period, in (0, 1) (at least one may): moves
    # are sized to the imbalance up to this, so a large swarm recovers from a mass preemption in a few
    # periods while a stage's peers never all leave together.
    max_move_fraction: float = 0.25
    # Periods after the one it arrived or moved in during which a peer may not move (>= 0).
    cooldown_periods: int = 3
    # Count "starting" peers (loading state, e.g. one that just moved) as capacity of their stage, so
    # a move under way is not repeated by another peer in the next period.
    count_starting: bool = True
    # Upper bound of the random delay a newcomer waits before picking its stage, seconds (>= 0).
    arrival_max_delay_s: float = 5.0

    def __post_init__(self) -> None:
        check_field_types(
            self,
            numbers=(
                "period_s",
                "min_gain",
                "min_move_fraction",
                "max_move_fraction",
                "arrival_max_delay_s",
            ),
            ints=("cooldown_periods",),
            bools=("count_starting",),
        )
        if self.period_s <= 0:
            raise ValueError(f"period_s must be > 0 seconds, got {self.period_s}")
        if self.min_gain < 0:
            raise ValueError(
                f"min_gain must be >= 0 (a relative gain, 0.1 = 10%), got {self.min_gain}"
            )
        if not 0.0 < self.min_move_fraction <= 1.0:
            raise ValueError(f"min_move_fraction must be in (0, 1], got {self.min_move_fraction}")
        if not 0.0 < self.max_move_fraction < 1.0:
            raise ValueError(f"max_move_fraction must be in (0, 1), got {self.max_move_fraction}")
        if self.cooldown_periods < 0:
            raise ValueError(f"cooldown_periods must be >= 0, got {self.cooldown_periods}")
        if self.arrival_max_delay_s < 0:
            raise ValueError(
                f"arrival_max_delay_s must be >= 0 seconds, got {self.arrival_max_delay_s}"
            )
