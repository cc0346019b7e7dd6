"""Configuration of the swarm simulator."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from swarm.balance import RebalanceConfig
from swarm.routing import RoutingConfig
from swarm.sim.links import LinkConfig

__all__ = ["Preemption", "SimConfig"]


@dataclass(frozen=True, kw_only=True)
class Preemption:
    """A scripted failure: at ``time_s`` a ``fraction`` of ``stage``'s serving peers die at once
    (a batch of spot instances reclaimed, a data centre losing power)."""

    # Simulated time of the failure, seconds.
    time_s: float
    # Stage whose peers die.
    stage: int
    # Fraction of that stage's serving peers that die, in (0, 1]; rounded to whole peers.
    fraction: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.time_s) and self.time_s >= 0):
            raise ValueError(
                f"Preemption.time_s must be finite and >= 0 seconds, got {self.time_s}"
            )
        if self.stage < 0:
            raise ValueError(f"Preemption.stage must be >= 0, got {self.stage}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"Preemption.fraction must be in (0, 1], got {self.fraction}")

    @classmethod
    def parse(cls, text: str) -> Preemption:
        """``"TIME_S:STAGE:FRACTION"``, e.g. ``"120:1:0.5"`` (the CLI form)."""
        parts = text.split(":")
        if len(parts) != 3:
            raise ValueError(
                f"a preemption is TIME_S:STAGE:FRACTION (e.g. 120:1:0.5), got {text!r}"
            )
        return cls(time_s=float(parts[0]), stage=int(parts[1]), fraction=float(parts[2]))


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated run; ``__post_init__`` checks every field and says which numbers clash."""

    # Pipeline stages.
    num_stages: int = 4
    # Peers present at t=0, placed one by one where each adds most (see choose_stage_on_arrival).
    num_peers: int = 100
    # Explicit initial placement (peers per stage, overrides num_peers); None = by arrival policy.
    initial_peers_per_stage: tuple[int, ...] | None = None
    # Explicit base speeds of the initial peers, samples/s (overrides the random draw); None = draw.
    peer_speeds: tuple[float, ...] | None = None
    # A peer's base speed (samples/s, forward + backward, stage of cost 1) is uniform in [min, max].
    peer_speed_min: float = 2.0
    peer_speed_max: float = 8.0
    # Relative compute cost per sample of each stage (speed on stage s = base / cost[s]); None = 1s.
    stage_costs: tuple[float, ...] | None = None
    # Trainers, each with its own Router (as real trainers have).
    num_trainers: int = 8
    # Microbatches each trainer keeps in flight.
    microbatches_in_flight: int = 32
    # Samples per microbatch.
    microbatch_size: int = 32
    # Share of a stage's forward + backward time spent in backward (backward costs ~2x forward).
    backward_share: float = 2.0 / 3.0
    # One-way network delay of every request and reply, seconds.
    latency_s: float = 0.05
    # Simulated duration, seconds.
    duration_s: float = 600.0
    # Poisson arrivals of new peers, per second (0 = none after t=0).
    arrival_rate_per_s: float = 0.0
    # Mean lifetime of a peer before it is preempted (exponential), seconds; 0 = peers never die.
    mean_lifetime_s: float = 0.0
    # Scripted correlated failures.
    preemptions: tuple[Preemption, ...] = ()
    # Whether peers run the rebalancing policy every balance.period_s.
    rebalance: bool = True
    # A moving peer keeps serving its old stage this long (routers drop it meanwhile), seconds.
    drain_s: float = 10.0
    # Time a peer spends "starting" (downloading a stage's parameters and state), seconds.
    load_s: float = 20.0
    # Trainers re-read the stage records this often, seconds (discovery lag).
    discovery_period_s: float = 5.0
    # Load shedding, as the peer daemon does (swarm.routing.shedding): a peer refuses at once a request that
    # its queue would finish after the caller's deadline (DeadlineUnmet: retried elsewhere, no ban); False =
    # it computes every request, even those whose caller already gave up (the daemon's --no-shed-late-work).
    skip_expired: bool = True
    # A peer refuses a request arriving behind more than this many seconds of queued compute (0 = unbounded);
    # the daemon's --max-queue-wait-s.
    max_queue_wait_s: float = 120.0
    # A trainer whose request ran out of attempts or found no peer waits this long, seconds.
    retry_wait_s: float = 1.0
    # Width of one sample of the output time series, seconds.
    sample_period_s: float = 10.0
    # Seed of every random draw (speeds, lifetimes, routing): equal seeds give equal runs.
    seed: int = 0
    balance: RebalanceConfig = field(default_factory=RebalanceConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    links: LinkConfig = field(default_factory=LinkConfig)

    def __post_init__(self) -> None:
        positive_ints = ("num_stages", "num_trainers", "microbatches_in_flight", "microbatch_size")
        for name in positive_ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SimConfig.{name} must be an int >= 1, got {value!r}")
        if (
            isinstance(self.num_peers, bool)
            or not isinstance(self.num_peers, int)
            or self.num_peers < 0
        ):
            raise ValueError(f"SimConfig.num_peers must be an int >= 0, got {self.num_peers!r}")
        for name in (
            "peer_speed_min",
            "peer_speed_max",
            "duration_s",
            "discovery_period_s",
            "retry_wait_s",
            "sample_period_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"SimConfig.{name} must be finite and > 0, got {value}")
        for name in (
            "latency_s",
            "arrival_rate_per_s",
            "mean_lifetime_s",
            "drain_s",
            "load_s",
            "max_queue_wait_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"SimConfig.{name} must be finite and >= 0, got {value}")
        if self.peer_speed_max < self.peer_speed_min:
            raise ValueError(
                f"peer_speed_max ({self.peer_speed_max}) must be >= peer_speed_min ({self.peer_speed_min})"
            )
        if not 0.0 < self.backward_share < 1.0:
            raise ValueError(f"backward_share must be in (0, 1), got {self.backward_share}")
        if self.stage_costs is not None:
            if len(self.stage_costs) != self.num_stages:
                raise ValueError(
                    f"stage_costs has {len(self.stage_costs)} entries for num_stages={self.num_stages}"
                )
            if not all(math.isfinite(c) and c > 0 for c in self.stage_costs):
                raise ValueError(f"stage_costs must all be finite and > 0, got {self.stage_costs}")
        if self.initial_peers_per_stage is not None:
            if len(self.initial_peers_per_stage) != self.num_stages:
                raise ValueError(
                    f"initial_peers_per_stage has {len(self.initial_peers_per_stage)} entries for "
                    f"num_stages={self.num_stages}"
                )
            if any(n < 0 for n in self.initial_peers_per_stage):
                raise ValueError(
                    f"initial_peers_per_stage must be >= 0, got {self.initial_peers_per_stage}"
                )
        if self.peer_speeds is not None:
            if len(self.peer_speeds) != self.initial_peer_count:
                raise ValueError(
                    f"peer_speeds has {len(self.peer_speeds)} entries for {self.initial_peer_count} "
                    "initial peers"
                )
            if not all(math.isfinite(s) and s > 0 for s in self.peer_speeds):
                raise ValueError(
                    f"peer_speeds must all be finite and > 0 samples/s, got {self.peer_speeds}"
                )
        for preemption in self.preemptions:
            if preemption.stage >= self.num_stages:
                raise ValueError(
                    f"a preemption hits stage {preemption.stage} but num_stages={self.num_stages}"
                )

    @property
    def initial_peer_count(self) -> int:
        if self.initial_peers_per_stage is not None:
            return sum(self.initial_peers_per_stage)
        return self.num_peers

    def stage_cost(self, stage: int) -> float:
        return 1.0 if self.stage_costs is None else float(self.stage_costs[stage])
