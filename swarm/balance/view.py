"""What a peer sees of the swarm when it decides whether to move: per-stage records, claims, moves.

The lead builds a :class:`SwarmView` from the DHT (stage records, claim records, the time each peer
last moved). Everything in it is remote input, so unusable numbers are read as "no capacity" rather
than raised on: one bad record must not stop every peer from deciding.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from swarm.states import PeerState

__all__ = [
    "PeerRecord",
    "SwarmView",
    "reachable_throughput",
    "stage_capacities",
    "usable_throughput",
]


class PeerRecord(NamedTuple):
    """One peer's announcement for one stage; a plain ``(throughput, state)`` tuple works as well."""

    # Samples/s the peer does for this stage, forward + backward.
    throughput: float
    # Serving, starting (loading state, not routed yet) or draining (leaving the stage). The wire strings
    # compare equal to the members; anything else counts as no capacity.
    state: PeerState


@dataclass(frozen=True, kw_only=True)
class SwarmView:
    """A snapshot of the swarm as one peer read it, at one time.

    ``stages[s]`` maps peer id -> :class:`PeerRecord` (or ``(throughput, state)``) for stage ``s``.
    A peer that is moving from ``a`` to ``b`` announces "draining" on ``a`` and "starting" on ``b``
    at the same time, so others count its capacity where it is going, not twice and not nowhere.

    ``claims[(stage, period_index)]`` holds the ids of the peers that claimed to leave ``stage`` in
    that period (a single id string is accepted too). ``last_moved_s[peer_id]`` is the time, on the
    same clock as ``now``, at which that peer last changed stage; peers absent never moved.
    ``stage_costs[s]`` is the relative compute cost of one sample in stage ``s`` (e.g. the stage with
    the LM head costs more); a peer doing ``t`` samples/s in ``a`` is assumed to do
    ``t * stage_costs[a] / stage_costs[b]`` in ``b``. ``None`` means all stages cost the same.
    """

    stages: Sequence[Mapping[str, PeerRecord | tuple[float, PeerState]]]
    claims: Mapping[tuple[int, int], Collection[str] | str] = field(default_factory=dict)
    last_moved_s: Mapping[str, float] = field(default_factory=dict)
    stage_costs: Sequence[float] | None = None

    def __post_init__(self) -> None:
        if len(self.stages) < 1:
            raise ValueError("SwarmView.stages must list at least one stage, got none")
        if self.stage_costs is not None:
            if len(self.stage_costs) != len(self.stages):
                raise ValueError(
                    f"SwarmView.stage_costs has {len(self.stage_costs)} entries for "
                    f"{len(self.stages)} stages; give one relative cost per stage or None"
                )
            for stage, cost in enumerate(self.stage_costs):
                if not (isinstance(cost, (int, float)) and math.isfinite(cost) and cost > 0):
                    raise ValueError(
                        f"SwarmView.stage_costs[{stage}] must be finite and > 0, got {cost!r}"
                    )

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def cost(self, stage: int) -> float:
        """Relative cost of one sample in ``stage`` (1.0 when no costs were given)."""
        return 1.0 if self.stage_costs is None else float(self.stage_costs[stage])

    def throughput_in(self, throughput: float, from_stage: int, to_stage: int) -> float:
        """Samples/s a peer doing ``throughput`` in ``from_stage`` is expected to do in ``to_stage``."""
        return throughput * self.cost(from_stage) / self.cost(to_stage)

    def claimers(self, stage: int, period_index: int) -> frozenset[str]:
        """Ids of the peers that claimed to leave ``stage`` in ``period_index`` (maybe none)."""
        found = self.claims.get((stage, period_index))
        if found is None:
            return frozenset()
        if isinstance(found, str):  # a bare id, not a collection of its characters
            return frozenset((found,))
        return frozenset(found)

    def stage_of(self, peer_id: str) -> int | None:
        """The stage ``peer_id`` serves ("serving" state), or ``None`` when it serves none."""
        for stage, peers in enumerate(self.stages):
            record = peers.get(peer_id)
            if record is not None and record[1] == PeerState.SERVING:
                return stage
        return None


def usable_throughput(value: object) -> float:
    """An announced throughput as a capacity, samples/s: non-numeric, NaN, inf or < 0 count as 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    if not math.isfinite(value) or value < 0:
        return 0.0
    return float(value)


def stage_capacities(view: SwarmView, *, count_starting: bool) -> list[float]:
    """Throughput of each stage, samples/s: the sum over its serving peers (and starting ones when
    ``count_starting``). Draining peers and unknown states count as nothing. O(peers)."""
    counted = (PeerState.SERVING, PeerState.STARTING) if count_starting else (PeerState.SERVING,)
    capacities = []
    for peers in view.stages:
        total = 0.0
        for record in peers.values():
            if record[1] in counted:
                total += usable_throughput(record[0])
        capacities.append(total)
    return capacities


def reachable_throughput(capacities: Sequence[float], view: SwarmView) -> float:
    """Swarm throughput, samples/s, if capacity could move between stages in arbitrary fractions.

    Peer capacity converts between stages by cost, so the swarm's work rate is
    ``W = sum_s capacities[s] * cost[s]`` and a perfectly balanced swarm runs every stage at
    ``X = W / sum_s cost[s]``. Whole peers can only do worse, so this is an upper bound of what
    rebalancing can reach; it is what ``RebalanceConfig.min_gain`` is compared with.
    """
    work = math.fsum(c * view.cost(s) for s, c in enumerate(capacities))
    return work / math.fsum(view.cost(s) for s in range(len(capacities)))
