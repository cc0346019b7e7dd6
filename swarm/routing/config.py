"""Configuration of the routing policy."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.schema import check_field_types

__all__ = ["RoutingConfig"]


@dataclass(frozen=True, kw_only=True)
class RoutingConfig:
    """Knobs of :class:`~swarm.routing.router.Router`; ``__post_init__`` checks every field."""

    FLAG_TITLE = "advanced: routing and retries"

    # Weight of the newest observation in the throughput and latency EMAs, in (0, 1].
    ema_alpha: float = 0.2
    # Lower bound of any per-peer RPC deadline, seconds.
    min_timeout_s: float = 1.0
    # Upper bound of any per-peer RPC deadline, seconds.
    max_timeout_s: float = 120.0
    # Deadline for a peer with no successful round trip yet, seconds, in [min, max].
    initial_timeout_s: float = 60.0
    # Deadline = timeout_factor * predicted round trip + timeout_slack_s (then clamped); >= 1.
    timeout_factor: float = 3.0
    # Seconds added to every measured deadline, covering jitter and small-request overheads.
    timeout_slack_s: float = 1.0
    # Ban after the first consecutive failure, seconds; doubles per further failure.
    ban_base_s: float = 1.0
    # Longest ban, seconds, >= ban_base_s.
    ban_max_s: float = 300.0
    # Attempts a single stage request may make (first try included) before RetriesExhausted.
    max_attempts: int = 5
    # Chance per choice to probe a never-measured, idle peer instead of a weighted draw, in [0, 1].
    explore_probability: float = 0.05
    # Peer ids whose ban history is kept (peers that left included); bounds memory under churn.
    max_ban_records: int = 10_000
    # A request that every eligible peer of its stage refused as busy (DeadlineUnmet) waits this long after
    # a refusal before it is sent to that peer again, seconds (its queue drains meanwhile; attempts are not
    # burnt in an instant). Larger stages retry elsewhere at once and never wait.
    shed_hold_s: float = 1.0
    # In a stage of more peers than this, a choice weighs a uniform random sample of this many (bounded cost
    # per request in stages of thousands); 0 = always weigh every peer.
    max_candidates: int = 32
    # Throughput prior (samples/s) when a stage has neither announcements nor measurements.
    default_throughput: float = 1.0

    def __post_init__(self) -> None:
        check_field_types(
            self,
            numbers=(
                "ema_alpha",
                "min_timeout_s",
                "max_timeout_s",
                "initial_timeout_s",
                "timeout_factor",
                "timeout_slack_s",
                "ban_base_s",
                "ban_max_s",
                "explore_probability",
                "default_throughput",
                "shed_hold_s",
            ),
            ints=("max_attempts", "max_ban_records", "max_candidates"),
        )
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.min_timeout_s <= 0:
            raise ValueError(f"min_timeout_s must be > 0 seconds, got {self.min_timeout_s}")
        if self.max_timeout_s < self.min_timeout_s:
            raise ValueError(
                f"max_timeout_s ({self.max_timeout_s}) must be >= min_timeout_s "
                f"({self.min_timeout_s})"
            )
        if not self.min_timeout_s <= self.initial_timeout_s <= self.max_timeout_s:
            raise ValueError(
                f"initial_timeout_s ({self.initial_timeout_s}) must lie in [min_timeout_s, "
                f"max_timeout_s] = [{self.min_timeout_s}, {self.max_timeout_s}]"
            )
        if self.timeout_factor < 1.0:
            raise ValueError(
                f"timeout_factor must be >= 1 (a deadline below the predicted round trip fails "
                f"healthy peers), got {self.timeout_factor}"
            )
        if self.timeout_slack_s < 0:
            raise ValueError(f"timeout_slack_s must be >= 0 seconds, got {self.timeout_slack_s}")
        if self.ban_base_s <= 0:
            raise ValueError(f"ban_base_s must be > 0 seconds, got {self.ban_base_s}")
        if self.ban_max_s < self.ban_base_s:
            raise ValueError(
                f"ban_max_s ({self.ban_max_s}) must be >= ban_base_s ({self.ban_base_s})"
            )
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0.0 <= self.explore_probability <= 1.0:
            raise ValueError(
                f"explore_probability must be in [0, 1], got {self.explore_probability}"
            )
        if self.max_ban_records < 1:
            raise ValueError(f"max_ban_records must be >= 1, got {self.max_ban_records}")
        if self.shed_hold_s < 0:
            raise ValueError(f"shed_hold_s must be >= 0 seconds, got {self.shed_hold_s}")
        if self.max_candidates < 0:
            raise ValueError(
                f"max_candidates must be >= 0 (0 = weigh every peer), got {self.max_candidates}"
            )
        if self.default_throughput <= 0:
            raise ValueError(
                f"default_throughput must be > 0 samples/s, got {self.default_throughput}"
            )

    def ban_duration_s(self, failures: int) -> float:
        """Ban length after ``failures`` consecutive failures (>= 1):
        ``min(ban_max_s, ban_base_s * 2 ** (failures - 1))``."""
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        # Cap the exponent so 2**k never overflows a float for peers that fail for days.
        exponent = min(failures - 1, 1023)
        return min(self.ban_max_s, self.ban_base_s * 2.0**exponent)
