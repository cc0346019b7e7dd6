"""Rebalancing policy: which stage a newcomer joins, and which peers move to the bottleneck stage.

Pure code (no I/O, clocks, asyncio; time is passed in, randomness through ``random.Random``),
shared by the peer daemon and the simulator. A pipeline runs at the speed of its slowest stage, so
capacity must follow the bottleneck without oscillating:

* :func:`choose_stage_on_arrival` / :func:`arrival_delay_s`: where a newcomer goes;
* :func:`decide_move`: once per :attr:`RebalanceConfig.period_s`, whether this peer moves, from a
  :class:`SwarmView` read from the DHT; :func:`claim_key` / :func:`is_my_turn` make sure at most
  :func:`move_budget` peers leave a stage per period.
"""

from swarm.balance.arrival import arrival_delay_s, choose_stage_on_arrival
from swarm.balance.claims import (
    claim_key,
    claim_rank,
    claim_winner,
    claim_winners,
    is_my_turn,
    period_index,
)
from swarm.balance.config import RebalanceConfig
from swarm.balance.policy import MoveDecision, decide_move, move_budget, plan_moves
from swarm.balance.view import PeerRecord, SwarmView, reachable_throughput, stage_capacities

__all__ = [
    "MoveDecision",
    "PeerRecord",
    "RebalanceConfig",
    "SwarmView",
    "arrival_delay_s",
    "choose_stage_on_arrival",
    "claim_key",
    "claim_rank",
    "claim_winner",
    "claim_winners",
    "decide_move",
    "is_my_turn",
    "move_budget",
    "period_index",
    "plan_moves",
    "reachable_throughput",
    "stage_capacities",
]
