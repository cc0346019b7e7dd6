"""The rebalancing decision: which peers move from rich stages to the bottleneck, this period.

Every peer runs :func:`decide_move` once per period on the view it read from the DHT. The function
is deterministic: all peers holding the same view compute the same plan, so exactly the peers the
plan names move, without a coordinator. Claims (see :mod:`swarm.balance.claims`) catch the cases
where views differ.

**The plan.** Let ``T[s]`` be stage ``s``'s capacity (serving, and by default starting, peers) and
``current = min_s T[s]`` the swarm throughput.

1. *Trigger.* Nothing moves unless ``reachable > current * (1 + min_gain)``, where ``reachable``
   is the throughput of a perfectly balanced swarm (:func:`~swarm.balance.view.reachable_throughput`).
   A literal "this one move must gain ``min_gain``" cannot work beyond a few peers per stage (with
   250 peers per stage one move gains 0.4%), so the gain is required of the rebalancing the move
   belongs to. It implies the literal rule whenever a single move suffices (3 + 1 peers: current 1,
   reachable 2).
2. *Steps.* Repeatedly: the destination ``b`` is the weakest stage (in the planned capacities) that
   gives no peer this period; sources are tried richest first among stages that received none this
   period and have budget left; the next mover of a stage is its fastest eligible serving peer not yet
   planned whose move passes the step rule below (a faster one would overshoot), ties broken by
   :func:`~swarm.balance.claims.claim_rank`. Fastest first because a move costs its capacity for the
   drain and the load, and a fast peer brings the most capacity per move and drains soonest: after 60%
   of a stage of a 1,000-peer swarm is preempted, slowest-first moved 184 peers (2.7 samples/s on
   average) whose drains took 39 s on average and up to 121 s, and the stage was back to 95% of an
   even spread after 3.7 periods; fastest-first moves 72 peers and is back after 1.7
   (bench/results/scale_sim.md). A step is taken when it raises the weaker of the two
   stages by at least ``min_move_fraction`` of the capacity the mover brings::

       useful = min(T[a] - t_a, T[b] + t_b) - T[b] >= min_move_fraction * t_b  (and > 0)

   where ``t_b = t_a * cost[a] / cost[b]``, and ``T`` is updated after every step. The first
   destination that no source can help ends the plan. So the moves are sized to the imbalance: a few
   peers when it is small, many in one period when a large swarm lost a large part of a stage, and
   never so many that a destination ends above its source (no overshoot).
3. *Budget.* A stage gives at most ``max(1, floor(max_move_fraction * serving peers))`` peers per
   period (never its last one), so its peers do not all leave together (no herding) even when the
   views they read differ. The daemon enforces it through claims: each mover writes a claim for
   ``(stage, period)`` and moves only if it ranks among the first ``budget`` claimers by
   :func:`~swarm.balance.claims.claim_rank` (:func:`~swarm.balance.claims.is_my_turn`).
4. *Eligible movers.* Serving, announced throughput > 0, not arrived or moved within the last
   ``cooldown_periods`` periods, in a stage with at least two serving peers. If peers already
   claimed to leave the stage this period, the claims hold the slots: only eligible claimers may
   leave it, at most ``budget`` of them, lowest rank first.

**Why it cannot oscillate.** Sort the stage capacities ascending. A step removes ``T[a]`` and
``T[b]`` (both >= ``T[b]``) and puts back two values that exceed ``T[b]``; every value below
``T[b]`` is untouched. So the sorted vector strictly increases in lexicographic order with every
move, and while throughputs stay what they are no configuration can come back: no peer, and no
group of peers, moves in a cycle. In particular the mover's own move back would need
``T[b] - (T[a] - t_a) > 0``, which the step rule excludes (a move that leaves its destination the
bottleneck by enough to justify the return is refused). When throughputs do change, ``min_gain``
(the swarm must be measurably unbalanced) and ``cooldown_periods`` bound the reaction to noise.

Cost: O(peers log peers + moves * stages log stages) per call; the view is scanned once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.balance.claims import claim_key, claim_rank, period_index
from swarm.balance.config import RebalanceConfig
from swarm.balance.view import (
    SwarmView,
    reachable_throughput,
    stage_capacities,
    usable_throughput,
)
from swarm.states import PeerState

__all__ = ["MoveDecision", "decide_move", "move_budget", "plan_moves"]


@dataclass(frozen=True, kw_only=True)
class MoveDecision:
    """One planned move: ``peer_id`` leaves ``from_stage`` for ``to_stage`` in ``period_index``.

    To carry it out the peer writes its claim under :attr:`claim_key`, re-reads it, checks
    :func:`~swarm.balance.claims.is_my_turn` with :attr:`budget`, then announces "draining" on ``from_stage`` and
    "starting" on ``to_stage`` (with ``throughput_to``) at once, drains, loads the new stage's state
    and turns "serving". Its last-move time must become visible to the others (cooldown).
    """

    peer_id: str
    from_stage: int
    to_stage: int
    period_index: int
    # The mover's samples/s in from_stage, and its expected samples/s in to_stage.
    throughput_from: float
    throughput_to: float
    # Swarm throughput (min over stages), samples/s: now, after all moves planned this period, and
    # the balanced bound that triggered rebalancing.
    swarm_throughput: float
    planned_throughput: float
    reachable_throughput: float
    # Peers the plan moves out of from_stage this period: how many claimers of that stage may go.
    budget: int = 1

    @property
    def claim_key(self) -> str:
        return claim_key(self.from_stage, self.period_index)


def decide_move(
    view: SwarmView, me: str, now: float, config: RebalanceConfig
) -> MoveDecision | None:
    """Should peer ``me`` move now? Its move from this period's plan, or ``None`` (stay).

    ``now`` is on the clock of ``view.last_moved_s`` and shared by all peers (the DHT time). The
    result depends only on ``(view, now, config)``: there is no randomness on purpose, since every
    peer must derive the same plan. See the module docstring for the rules and the no-oscillation
    argument.
    """
    for move in plan_moves(view, now, config):
        if move.peer_id == me:
            return move
    return None


def plan_moves(view: SwarmView, now: float, config: RebalanceConfig) -> list[MoveDecision]:
    """All moves of this period's plan, as every peer holding ``view`` computes it (see module doc)."""
    num_stages = view.num_stages
    if num_stages < 2:
        return []
    period = period_index(now, config.period_s)
    capacities = stage_capacities(view, count_starting=config.count_starting)
    current = min(capacities)
    reachable = reachable_throughput(capacities, view)
    if not reachable > current * (1.0 + config.min_gain):
        return []

    movers, budgets = zip(*(_movers(view, stage, period, config) for stage in range(num_stages)))
    planned = list(capacities)
    taken = [0] * num_stages  # movers planned out of each stage so far
    received: set[int] = set()
    planned_ids: set[str] = set()
    steps: list[tuple[str, int, int, float, float]] = []
    while True:
        gave = {s for s in range(num_stages) if taken[s]}
        to_stage = min(
            (s for s in range(num_stages) if s not in gave),
            key=lambda s: (planned[s], s),
            default=None,
        )
        if to_stage is None:
            break
        sources = sorted(
            (
                s
                for s in range(num_stages)
                if s != to_stage and s not in received and taken[s] < budgets[s]
            ),
            key=lambda s: (-planned[s], s),
        )
        step = None
        for from_stage in sources:
            # The fastest mover not yet planned whose move fits; faster ones would overshoot.
            for peer_id, t_from in movers[from_stage]:
                if peer_id in planned_ids:
                    continue
                t_to = view.throughput_in(t_from, from_stage, to_stage)
                after_from, after_to = planned[from_stage] - t_from, planned[to_stage] + t_to
                useful = min(after_from, after_to) - planned[to_stage]
                if useful > 0 and useful >= config.min_move_fraction * t_to:
                    step = (peer_id, from_stage, to_stage, t_from, t_to)
                    planned[from_stage], planned[to_stage] = after_from, after_to
                    break
            if step is not None:
                break
        if step is None:
            break
        steps.append(step)
        planned_ids.add(step[0])
        taken[step[1]] += 1
        received.add(step[2])

    planned_min = min(planned)
    return [
        MoveDecision(
            peer_id=peer_id,
            from_stage=from_stage,
            to_stage=to_stage,
            period_index=period,
            throughput_from=t_from,
            throughput_to=t_to,
            swarm_throughput=current,
            planned_throughput=planned_min,
            reachable_throughput=reachable,
            budget=taken[from_stage],
        )
        for peer_id, from_stage, to_stage, t_from, t_to in steps
    ]


def move_budget(serving_peers: int, config: RebalanceConfig) -> int:
    """Most peers a stage of ``serving_peers`` may give in one period: ``max_move_fraction`` of them,
    at least one, and never the last one."""
    if serving_peers < 2:
        return 0
    return min(serving_peers - 1, max(1, math.floor(config.max_move_fraction * serving_peers)))


def _movers(
    view: SwarmView, stage: int, period: int, config: RebalanceConfig
) -> tuple[list[tuple[str, float]], int]:
    """The peers of ``stage`` that may leave it this period, in the order they would be tried (each with
    its samples/s), and how many of them may leave (its budget)."""
    serving: dict[str, float] = {}
    for peer_id, record in view.stages[stage].items():
        if record[1] == PeerState.SERVING:
            serving[peer_id] = usable_throughput(record[0])
    budget = move_budget(len(serving), config)
    if budget == 0:  # the last serving peer of a stage never leaves it
        return [], 0
    eligible = {
        peer_id: throughput
        for peer_id, throughput in serving.items()
        if throughput > 0 and not _cooling_down(view, peer_id, period, config)
    }
    claimers = view.claimers(stage, period)
    if claimers:
        # The slots are taken: only the claimers every peer agrees on may use them, even if this view
        # would have picked others (views differ; the claims are the tie-breaker).
        ranked = sorted(claimers, key=lambda peer_id: (claim_rank(peer_id, period), peer_id))
        allowed = [(p, eligible[p]) for p in ranked[:budget] if p in eligible]
        return allowed, len(allowed)
    # Fastest first (the fewest moves, the shortest drains: see the module docstring); equal speeds by
    # rank. Ranks are hashed only for the peers that can move, and only when speeds tie. Every eligible
    # peer is listed (the plan skips those whose move would overshoot); the plan takes at most budget.
    order = sorted(eligible.items(), key=lambda item: -item[1])
    if len({t for _, t in order}) < len(order):
        order.sort(key=lambda item: (-item[1], claim_rank(item[0], period), item[0]))
    return order, min(budget, len(order))


def _cooling_down(view: SwarmView, peer_id: str, period: int, config: RebalanceConfig) -> bool:
    last = view.last_moved_s.get(peer_id)
    if last is None:
        return False
    if isinstance(last, bool) or not isinstance(last, (int, float)) or not math.isfinite(last):
        return True  # an unreadable time is remote garbage: staying put is the safe reading
    return period - period_index(last, config.period_s) <= config.cooldown_periods
