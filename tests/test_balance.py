"""Unit tests of the rebalancing policy (swarm.balance): pure, deterministic, no sleeps."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from swarm.balance import (
    MoveDecision,
    PeerRecord,
    RebalanceConfig,
    SwarmView,
    arrival_delay_s,
    choose_stage_on_arrival,
    claim_key,
    claim_winner,
    claim_winners,
    decide_move,
    is_my_turn,
    move_budget,
    period_index,
    plan_moves,
    stage_capacities,
)
from swarm.states import PeerState

PERIOD_S = 60.0
CONFIG = RebalanceConfig(period_s=PERIOD_S, min_gain=0.1, cooldown_periods=3)


def view_of(stages: list[dict[str, float]], **kwargs) -> SwarmView:
    """A view whose peers all serve, from per-stage dicts peer id -> samples/s."""
    return SwarmView(
        stages=[
            {pid: PeerRecord(t, PeerState.SERVING) for pid, t in peers.items()} for peers in stages
        ],
        **kwargs,
    )


def apply_moves(view: SwarmView, moves: list[MoveDecision], now: float) -> SwarmView:
    """The view after ``moves``: each mover serves its new stage at its expected throughput and its
    move time is recorded (what the daemon announces once it has loaded the stage)."""
    stages = [dict(peers) for peers in view.stages]
    last_moved = dict(view.last_moved_s)
    for move in moves:
        del stages[move.from_stage][move.peer_id]
        stages[move.to_stage][move.peer_id] = PeerRecord(move.throughput_to, PeerState.SERVING)
        last_moved[move.peer_id] = now
    return SwarmView(stages=stages, last_moved_s=last_moved, stage_costs=view.stage_costs)


def run_periods(view: SwarmView, periods: int, config: RebalanceConfig = CONFIG, start: int = 0):
    """Every peer decides once per period on the same view; returns the final view and all moves.

    Checks on the way that the decisions of all peers agree with one plan, that no stage gives more
    peers per period than its budget and that no stage is ever emptied.
    """
    moves: list[MoveDecision] = []
    for period in range(start, start + periods):
        now = period * config.period_s + 1.0
        everyone = [pid for peers in view.stages for pid in peers]
        decided = [
            m for m in (decide_move(view, pid, now, config) for pid in everyone) if m is not None
        ]
        planned = plan_moves(view, now, config)
        assert sorted(decided, key=_peer_id) == sorted(planned, key=_peer_id)
        assert_within_budget(view, decided, config)
        view = apply_moves(view, decided, now)
        assert all(len(peers) >= 1 for peers in view.stages), "a stage was emptied"
        moves.extend(decided)
    return view, moves


def assert_within_budget(view: SwarmView, moves: list[MoveDecision], config: RebalanceConfig):
    per_stage = Counter(m.from_stage for m in moves)
    for stage, count in per_stage.items():
        serving = sum(1 for r in view.stages[stage].values() if r[1] == PeerState.SERVING)
        assert count <= move_budget(serving, config), (stage, count, serving)
        assert all(m.budget == count for m in moves if m.from_stage == stage)
    assert not set(per_stage) & {m.to_stage for m in moves}  # no stage both gives and receives


def _peer_id(move: MoveDecision) -> str:
    return move.peer_id


def sorted_capacities(view: SwarmView) -> list[float]:
    return sorted(stage_capacities(view, count_starting=True))


# ---- arrival ------------------------------------------------------------------------------


def test_arrival_fills_the_empty_stage():
    assert choose_stage_on_arrival([5.0, 0.0, 3.0], 1.0, random.Random(0)) == 1


def test_arrival_joins_the_weakest_stage():
    assert choose_stage_on_arrival([5.0, 2.0, 3.0], 1.0, random.Random(0)) == 1
    # Even a peer much faster than the gap goes to the bottleneck: anywhere else the min stays 2.
    assert choose_stage_on_arrival([5.0, 2.0, 3.0], [1.0, 100.0, 1.0], random.Random(0)) == 1


def test_arrival_ties_go_to_the_weakest_stages_at_random():
    chosen = Counter(
        choose_stage_on_arrival([4.0, 0.0, 0.0], 1.0, random.Random(seed)) for seed in range(200)
    )
    assert set(chosen) == {1, 2}
    assert min(chosen.values()) > 60  # both empty stages are drawn, not always the first


def test_arrivals_one_after_another_spread_over_stages():
    capacities = [0.0] * 4
    rng = random.Random(1)
    for _ in range(8):
        stage = choose_stage_on_arrival(capacities, 1.0, rng)
        capacities[stage] += 1.0  # the newcomer announces "starting": the next one counts it
    assert capacities == [2.0] * 4


def test_arrival_per_stage_estimates_are_used():
    # Stage 1 costs 4x: the newcomer's 0.25 samples/s there cannot lift it above stage 0's 1.0, so
    # joining stage 1 (min 1.0 -> 1.0) and stage 0 (min stays 0.5) compare on real numbers.
    assert choose_stage_on_arrival([1.0, 0.5], [1.0, 0.25], random.Random(0)) == 1
    assert choose_stage_on_arrival([1.0, 0.9], [1.0, 0.25], random.Random(0)) == 1


@pytest.mark.parametrize(
    ("capacities", "mine", "match"),
    [
        ([], 1.0, "empty"),
        ([1.0, -1.0], 1.0, r"stage_throughputs\[1\].*-1.0"),
        ([1.0, float("nan")], 1.0, r"stage_throughputs\[1\]"),
        ([1.0, 1.0], [1.0], "1 entries for 2 stages"),
        ([1.0, 1.0], 0.0, "stage 0.*0.0"),
        ([1.0, 1.0], [1.0, float("inf")], "stage 1"),
    ],
)
def test_arrival_rejects_bad_input(capacities, mine, match):
    with pytest.raises(ValueError, match=match):
        choose_stage_on_arrival(capacities, mine, random.Random(0))


def test_arrival_delay_is_bounded_and_spread():
    rng = random.Random(0)
    delays = [arrival_delay_s(rng, 5.0) for _ in range(1000)]
    assert all(0.0 <= d <= 5.0 for d in delays)
    assert min(delays) < 0.5 and max(delays) > 4.5
    assert arrival_delay_s(rng, 0.0) == 0.0
    with pytest.raises(ValueError, match="-1"):
        arrival_delay_s(rng, -1.0)


# ---- the 3 + 1 swarm ----------------------------------------------------------------------


def three_plus_one() -> SwarmView:
    return view_of([{"a": 1.0, "b": 1.0, "c": 1.0}, {"d": 1.0}])


def test_exactly_one_peer_moves_to_the_bottleneck_and_throughput_doubles():
    view = three_plus_one()
    now = 1.0
    decisions = {pid: decide_move(view, pid, now, CONFIG) for pid in "abcd"}
    movers = {pid: d for pid, d in decisions.items() if d is not None}
    assert len(movers) == 1
    (move,) = movers.values()
    assert (move.from_stage, move.to_stage) == (0, 1)
    assert move.swarm_throughput == 1.0 and move.planned_throughput == 2.0
    after = apply_moves(view, [move], now)
    assert min(stage_capacities(after, count_starting=True)) >= 1.5 * min(
        stage_capacities(view, count_starting=True)
    )


def test_the_next_ten_periods_move_nobody_back_and_forth():
    view, moves = run_periods(three_plus_one(), 11)
    assert len(moves) == 1  # the first period's move, then a balanced swarm stays put
    assert [len(peers) for peers in view.stages] == [2, 2]
    stages_visited = Counter(m.peer_id for m in moves)
    assert max(stages_visited.values()) == 1


def test_the_same_peer_is_chosen_whatever_the_dict_order():
    forward = three_plus_one()
    backward = view_of([{"c": 1.0, "b": 1.0, "a": 1.0}, {"d": 1.0}])
    assert plan_moves(forward, 1.0, CONFIG) == plan_moves(backward, 1.0, CONFIG)


def test_the_fastest_peer_that_fits_moves():
    view = view_of([{"a": 3.0, "b": 1.0, "c": 2.0}, {"d": 1.0}, {"e": 5.0, "f": 0.5}])
    # [6, 1, 5.5]: the richest stage gives its fastest peer (a: [3, 4, 5.5]); the next richest's fastest
    # (e) would overshoot ([3, 9, 0.5]), so its next one goes (f: [3, 4.5, 5]).
    moves = plan_moves(view, 1.0, CONFIG)
    assert [(m.peer_id, m.from_stage, m.to_stage) for m in moves] == [("a", 0, 1), ("f", 2, 1)]
    assert moves[0].planned_throughput == 3.0


def test_a_large_imbalance_is_closed_by_few_fast_movers():
    # 3 stages of 40 peers (10 at 4.0 samples/s, 30 at 1.0) and a stage left with 10 slow ones: [70, 10, 70, 70].
    # The fast peers close the deficit (each brings 4x a slow one); slow ones fill the rest where a fast
    # one would overshoot. Slowest-first would spend each stage's budget (10) on 1.0 peers: [60, 40, 60, 60].
    fast, slow = {f"f{i}": 4.0 for i in range(10)}, {f"s{i}": 1.0 for i in range(30)}
    stages = [{f"{s}{p}": t for p, t in {**fast, **slow}.items()} for s in "abc"]
    view = view_of([stages[0], {f"d{i}": 1.0 for i in range(10)}, stages[1], stages[2]])
    moves = plan_moves(view, 1.0, CONFIG)
    assert {m.to_stage for m in moves} == {1}
    assert [m.throughput_from for m in moves] == [4.0] * 11 + [1.0] * 2
    assert max(Counter(m.from_stage for m in moves).values()) <= 10  # the budget of a 40-peer stage
    assert moves[0].planned_throughput == 54.0  # [54, 56, 54, 56]: balanced within one slow peer


# ---- the rules ------------------------------------------------------------------------------


def test_min_gain_is_respected():
    view = view_of([{f"a{i}": 1.0 for i in range(12)}, {f"b{i}": 1.0 for i in range(10)}])
    # Balanced, the swarm would run at 11 = current 10 + 10%: not strictly more than min_gain.
    assert plan_moves(view, 1.0, RebalanceConfig(min_gain=0.1)) == []
    (move,) = plan_moves(view, 1.0, RebalanceConfig(min_gain=0.05))
    assert (move.from_stage, move.to_stage, move.planned_throughput) == (0, 1, 11.0)
    # The 3 + 1 swarm can double: min_gain 1.0 asks for more than that, 0.99 does not.
    assert plan_moves(three_plus_one(), 1.0, RebalanceConfig(min_gain=1.0)) == []
    assert len(plan_moves(three_plus_one(), 1.0, RebalanceConfig(min_gain=0.99))) == 1


def test_a_move_that_only_swaps_the_bottleneck_is_refused():
    # Moving the 2.0 peer would give [2, 3]: stage 0 becomes a worse bottleneck than stage 1 was.
    view = view_of([{"a": 2.0, "b": 2.0}, {"c": 2.5}])
    assert plan_moves(view, 1.0, RebalanceConfig(min_gain=0.0)) == []
    # Moving 1.0 of a 2 + 1 stage to a 1.0 stage: [2, 2] (useful 1.0); fine.
    view = view_of([{"a": 2.0, "b": 1.0}, {"c": 1.0}])
    assert len(plan_moves(view, 1.0, RebalanceConfig(min_gain=0.0))) == 1


def test_overshooting_moves_are_refused_by_min_move_fraction():
    # [4, 1.5] -> [2, 3.5]: stage 1 gains 2.0 but the pair's weaker side only rises by 0.5 < 0.5 * 2.
    view = view_of([{"a": 2.0, "b": 2.0}, {"c": 1.5}])
    assert plan_moves(view, 1.0, RebalanceConfig(min_gain=0.0, min_move_fraction=0.5)) == []
    assert len(plan_moves(view, 1.0, RebalanceConfig(min_gain=0.0, min_move_fraction=0.25))) == 1


def test_a_stage_is_never_emptied():
    assert plan_moves(view_of([{"a": 10.0}, {"b": 1.0}]), 1.0, CONFIG) == []
    # An empty stage is filled from one with two peers.
    (move,) = plan_moves(view_of([{"a": 1.0, "b": 1.0}, {}]), 1.0, CONFIG)
    assert (move.from_stage, move.to_stage) == (0, 1)


def test_cooldown_is_respected():
    moved_at = 2 * PERIOD_S + 5.0  # during period 2
    cooling = SwarmView(stages=three_plus_one().stages, last_moved_s={p: moved_at for p in "abc"})
    for period in (2, 3, 4, 5):  # cooldown_periods=3: periods 3, 4, 5 are still blocked
        assert plan_moves(cooling, period * PERIOD_S + 1.0, CONFIG) == []
    assert len(plan_moves(cooling, 6 * PERIOD_S + 1.0, CONFIG)) == 1
    # Only the fastest is cooling down: the next one in line moves instead.
    view = SwarmView(
        stages=view_of([{"a": 1.0, "b": 2.0, "c": 3.0}, {"d": 1.0}]).stages,
        last_moved_s={"c": moved_at},
    )
    (move,) = plan_moves(view, 3 * PERIOD_S, CONFIG)
    assert move.peer_id == "b"
    # An unreadable move time is read as "just moved".
    view = SwarmView(stages=three_plus_one().stages, last_moved_s={p: float("nan") for p in "abc"})
    assert plan_moves(view, 1.0, CONFIG) == []


def test_draining_peers_do_not_count_and_starting_ones_do():
    stages = [
        {p: PeerRecord(1.0, PeerState.SERVING) for p in "abc"},
        {"d": PeerRecord(1.0, PeerState.SERVING), "e": PeerRecord(1.0, PeerState.STARTING)},
    ]
    assert plan_moves(SwarmView(stages=stages), 1.0, CONFIG) == []  # [3, 2]: balanced enough
    ignoring = RebalanceConfig(period_s=PERIOD_S, count_starting=False)
    assert len(plan_moves(SwarmView(stages=stages), 1.0, ignoring)) == 1
    stages[0]["c"] = PeerRecord(1.0, PeerState.DRAINING)  # leaving: [2, 2]
    assert stage_capacities(SwarmView(stages=stages), count_starting=True) == [2.0, 2.0]
    # Bad remote numbers count as no capacity instead of raising.
    stages[1]["e"] = (float("nan"), PeerState.STARTING)
    assert stage_capacities(SwarmView(stages=stages), count_starting=True) == [2.0, 1.0]


def test_stage_costs_convert_the_movers_throughput():
    # Stage 1 costs twice as much: a peer doing 2/s in stage 0 does 1/s in stage 1.
    view = view_of(
        [{f"a{i}": 2.0 for i in range(4)}, {"b0": 1.0, "b1": 1.0}], stage_costs=[1.0, 2.0]
    )
    final, moves = run_periods(view, 10)
    assert [m.throughput_to for m in moves] == [1.0, 1.0]
    assert stage_capacities(final, count_starting=True) == [4.0, 4.0]


def test_several_weak_stages_are_filled_over_periods():
    view = view_of(
        [{f"a{i}": 50.0 for i in range(6)}]
        + [{f"s{k}{i}": 50.0 for i in range(2)} for k in range(3)]
    )
    final, moves = run_periods(view, 10)
    assert stage_capacities(final, count_starting=True) == [150.0] * 4
    assert len(moves) == 3 and {m.from_stage for m in moves} == {0}
    assert len({m.period_index for m in moves}) == 3  # one departure from stage 0 per period


def test_several_sources_give_in_one_period_without_overshooting():
    # Two rich stages, one poor: both may give in one period, never more than the poor one needs.
    view = view_of(
        [{f"a{i}": 1.0 for i in range(4)}, {f"b{i}": 1.0 for i in range(4)}, {"c0": 1.0}]
    )
    moves = plan_moves(view, 1.0, CONFIG)
    assert sorted((m.from_stage, m.to_stage) for m in moves) == [(0, 2), (1, 2)]
    assert all(m.planned_throughput == 3.0 for m in moves)


# ---- claims -------------------------------------------------------------------------------


def test_claims_name_one_winner_for_everyone():
    claimers = {"p1", "p2", "p3"}
    winner = claim_winner(claimers, 7)
    assert [is_my_turn(claimers, p, 7) for p in sorted(claimers)].count(True) == 1
    assert is_my_turn(claimers, winner, 7)
    assert not is_my_turn(claimers, "p4", 7)  # no claim of mine visible: stay
    assert is_my_turn("p1", "p1", 7)  # a bare id is one claimer, not three characters
    assert claim_winner(set(), 7) is None
    # The winner rotates between periods rather than always favouring one id.
    assert len({claim_winner(claimers, period) for period in range(50)}) == 3
    assert claim_key(2, 9) == "rebalance/2/9"
    assert period_index(125.0, 60.0) == 2


def test_a_claim_by_another_peer_takes_the_stage_slot():
    now = 1.0
    period = period_index(now, PERIOD_S)
    base = three_plus_one()
    planned = (
        decide_move(base, "a", now, CONFIG)
        or decide_move(base, "b", now, CONFIG)
        or decide_move(base, "c", now, CONFIG)
    )
    other = next(p for p in "abc" if p != planned.peer_id)
    claimed = SwarmView(stages=base.stages, claims={(0, period): {other}})
    assert decide_move(claimed, planned.peer_id, now, CONFIG) is None
    assert decide_move(claimed, other, now, CONFIG).peer_id == other
    # A claim from a peer that may not move (cooling down) blocks the slot for everyone.
    blocked = SwarmView(stages=base.stages, claims={(0, period): other}, last_moved_s={other: 0.0})
    assert plan_moves(blocked, now, CONFIG) == []
    # Claims of another period do not matter.
    stale = SwarmView(stages=base.stages, claims={(0, period - 1): {other}})
    assert plan_moves(stale, now, CONFIG) == plan_moves(base, now, CONFIG)


# ---- moves sized to the imbalance, within a budget ------------------------------------------


def test_budget_is_a_quarter_of_a_stage_at_least_one_never_the_last():
    assert [move_budget(n, CONFIG) for n in (0, 1, 2, 3, 7, 8, 9, 100, 1000)] == [
        0,
        0,
        1,
        1,
        1,
        2,
        2,
        25,
        250,
    ]
    assert move_budget(10, RebalanceConfig(max_move_fraction=0.5)) == 5
    with pytest.raises(ValueError, match=r"max_move_fraction must be in \(0, 1\), got 1.0"):
        RebalanceConfig(max_move_fraction=1.0)


def test_a_large_stage_loss_is_refilled_by_many_moves_in_one_period():
    # 4 stages of 100 equal peers; 60 of stage 2 are gone: 40 left against 100.
    stages = [{f"s{s}p{i}": 1.0 for i in range(100)} for s in range(4)]
    stages[2] = {f"s2p{i}": 1.0 for i in range(40)}
    view = view_of(stages)
    moves = plan_moves(view, 1.0, CONFIG)
    # Balanced is 85 per stage: each rich stage gives 15, well inside its budget of 25, and no more
    # (that would overshoot: stage 2 would end above its sources).
    assert Counter(m.from_stage for m in moves) == {0: 15, 1: 15, 3: 15}
    assert {m.to_stage for m in moves} == {2}
    after = stage_capacities(apply_moves(view, moves, 1.0), count_starting=True)
    assert after == [85.0] * 4
    # Balanced now: the next period moves nobody (the movers are cooling down, the rest see no gain).
    assert plan_moves(apply_moves(view, moves, 1.0), PERIOD_S + 1.0, CONFIG) == []


def test_the_budget_caps_a_period_and_the_rest_follows_in_the_next():
    stages = [{f"a{i}": 1.0 for i in range(20)}, {"b0": 1.0}]
    final, moves = run_periods(view_of(stages), 3)
    per_period = Counter(m.period_index for m in moves)
    # 20 + 1 -> 10.5 each: 5 (a quarter of 20) in the first period, then a quarter of the 15 left.
    assert per_period[0] == 5 and per_period[1] == 3 and per_period[2] == 1
    assert all(m.planned_throughput <= 10.5 for m in moves)


def test_claims_let_at_most_the_budget_leave_whatever_the_views():
    claimers = {f"p{i}" for i in range(10)}
    winners = claim_winners(claimers, 4, budget=3)
    assert len(winners) == 3 and winners <= claimers
    assert sum(is_my_turn(claimers, p, 4, budget=3) for p in claimers) == 3
    assert all(is_my_turn(claimers, p, 4, budget=3) == (p in winners) for p in claimers)
    # The ranking is the same for every budget: a larger budget adds claimers, never swaps them.
    assert winners <= claim_winners(claimers, 4, budget=5)
    assert claim_winners(claimers, 4, budget=1) == {claim_winner(claimers, 4)}
    with pytest.raises(ValueError, match="budget must be >= 1"):
        is_my_turn(claimers, "p0", 4, budget=0)


def test_a_herd_of_claims_moves_only_the_budget():
    # Every peer of stage 0 read a different view and claimed: only the budget's worth may leave.
    stages = [{f"a{i}": 1.0 for i in range(12)}, {"b0": 1.0}]
    period = 0
    claimed = view_of(stages, claims={(0, period): {f"a{i}" for i in range(12)}})
    moves = plan_moves(claimed, 1.0, CONFIG)
    assert len(moves) == move_budget(12, CONFIG) == 3
    assert {m.peer_id for m in moves} == claim_winners({f"a{i}" for i in range(12)}, period, 3)


# ---- no oscillation -------------------------------------------------------------------------


def random_view(rng: random.Random) -> SwarmView:
    num_stages = rng.randint(2, 6)
    stages = [
        {
            f"s{s}p{i}": rng.choice([0.5, 1.0, 1.0, 2.0, 3.0, rng.uniform(0.1, 4.0)])
            for i in range(rng.choice([1, 2, 3, 5, 8, 20]))
        }
        for s in range(num_stages)
    ]
    costs = (
        [rng.choice([1.0, 1.0, 1.5, 2.0]) for _ in range(num_stages)]
        if rng.random() < 0.5
        else None
    )
    return view_of(stages, stage_costs=costs)


@pytest.mark.parametrize("seed", range(40))
def test_random_swarms_converge_and_never_revisit_a_configuration(seed):
    rng = random.Random(seed)
    view = random_view(rng)
    # No cooldown and no minimum gain: the hysteresis of the step rule alone must prevent cycles.
    config = RebalanceConfig(period_s=PERIOD_S, min_gain=0.0, cooldown_periods=0)
    seen = {tuple(sorted((pid, s) for s, peers in enumerate(view.stages) for pid in peers))}
    potential = sorted_capacities(view)
    for period in range(500):
        now = period * PERIOD_S + 1.0
        moves = plan_moves(view, now, config)
        if not moves:
            break
        assert_within_budget(view, moves, config)
        for move in moves:
            # The mover would not be sent straight back, even with its cooldown lifted.
            after = apply_moves(view, [move], now)
            lifted = SwarmView(stages=after.stages, stage_costs=after.stage_costs)
            back = decide_move(lifted, move.peer_id, now + PERIOD_S, config)
            assert back is None or back.to_stage != move.from_stage
        view = apply_moves(view, moves, now)
        assert all(len(peers) >= 1 for peers in view.stages)
        new_potential = sorted_capacities(view)
        assert new_potential > potential  # lexicographic: strictly better every period
        potential = new_potential
        state = tuple(sorted((pid, s) for s, peers in enumerate(view.stages) for pid in peers))
        assert state not in seen
        seen.add(state)
    else:
        pytest.fail("rebalancing did not settle within 500 periods")


def test_measurement_noise_on_a_balanced_swarm_moves_nobody():
    rng = random.Random(3)
    true_speed = {f"s{s}p{i}": rng.uniform(0.5, 2.0) for s in range(4) for i in range(50)}
    # Balance the stages exactly first, then announce each period with +-5% noise.
    stages: list[dict[str, float]] = [{} for _ in range(4)]
    for pid, speed in sorted(true_speed.items(), key=lambda kv: -kv[1]):
        weakest = min(range(4), key=lambda s: sum(stages[s].values()))
        stages[weakest][pid] = speed
    for period in range(50):
        noisy = [{pid: t * rng.uniform(0.95, 1.05) for pid, t in peers.items()} for peers in stages]
        assert plan_moves(view_of(noisy), period * PERIOD_S, CONFIG) == []


# ---- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"period_s": 0.0}, "period_s must be > 0 seconds, got 0.0"),
        ({"period_s": float("inf")}, "period_s must be a finite number"),
        ({"min_gain": -0.1}, "min_gain must be >= 0.*-0.1"),
        ({"min_move_fraction": 0.0}, r"min_move_fraction must be in \(0, 1\], got 0.0"),
        ({"min_move_fraction": 1.5}, "got 1.5"),
        ({"cooldown_periods": -1}, "cooldown_periods must be >= 0, got -1"),
        ({"cooldown_periods": 1.5}, "cooldown_periods must be an int"),
        ({"count_starting": 1}, "count_starting must be a bool"),
        ({"arrival_max_delay_s": -2.0}, "arrival_max_delay_s must be >= 0 seconds, got -2.0"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RebalanceConfig(**kwargs)


def test_view_validation():
    with pytest.raises(ValueError, match="at least one stage"):
        SwarmView(stages=[])
    with pytest.raises(ValueError, match="3 entries for 2 stages"):
        view_of([{"a": 1.0}, {"b": 1.0}], stage_costs=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"stage_costs\[1\].*0"):
        view_of([{"a": 1.0}, {"b": 1.0}], stage_costs=[1.0, 0.0])
    with pytest.raises(ValueError, match="finite time"):
        period_index(float("nan"), 60.0)
