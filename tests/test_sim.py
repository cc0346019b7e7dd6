"""Tests of the swarm simulator (swarm.sim): small, seeded runs of a few simulated minutes."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.balance import RebalanceConfig
from swarm.sim import Preemption, SimConfig, format_table, main, simulate


def test_a_peer_four_times_slower_gets_a_fifth_of_the_work():
    config = SimConfig(
        num_stages=1,
        peer_speeds=(4.0, 1.0),
        num_peers=2,
        num_trainers=2,
        microbatches_in_flight=2,
        microbatch_size=4,
        duration_s=600.0,
        rebalance=False,
    )
    result = simulate(config)
    total = sum(result.requests_by_peer.values())
    assert total > 500
    assert result.requests_by_peer["p1"] / total == pytest.approx(0.2, abs=0.03)


def test_killing_peers_loses_no_microbatch():
    config = SimConfig(
        num_stages=3,
        initial_peers_per_stage=(4, 4, 4),
        num_trainers=2,
        microbatches_in_flight=4,
        microbatch_size=8,
        duration_s=240.0,
        rebalance=False,
        preemptions=(
            Preemption(time_s=60.0, stage=1, fraction=0.5),
            Preemption(time_s=90.0, stage=0, fraction=0.5),
        ),
    )
    result = simulate(config)
    assert result.peers_died == 2 + 2
    assert result.hop_failures > 0 and result.recomputes > 0  # the kills did hit requests in flight
    assert (
        result.microbatches_started == result.microbatches_completed + result.microbatches_in_flight
    )
    # Every microbatch started before the kills (and their retries) has finished since.
    assert result.oldest_in_flight_started_s > 150.0
    assert result.mean_throughput(180.0) > 0.0


def imbalanced(rebalance: bool) -> SimConfig:
    return SimConfig(
        num_stages=2,
        initial_peers_per_stage=(6, 2),
        peer_speeds=(4.0,) * 8,
        num_trainers=4,
        microbatches_in_flight=4,
        microbatch_size=8,
        duration_s=300.0,
        sample_period_s=20.0,
        rebalance=rebalance,
        balance=RebalanceConfig(period_s=10.0, cooldown_periods=3),
    )


def test_rebalancing_fixes_an_imbalance_and_then_stays_put():
    result = simulate(imbalanced(rebalance=True))
    static = simulate(imbalanced(rebalance=False))
    assert [(m.from_stage, m.to_stage) for m in result.moves] == [(0, 1), (0, 1)]
    assert result.peers_per_stage[-1] == (4, 4)
    assert static.peers_per_stage[-1] == (6, 2) and static.num_moves == 0
    # Stage 1 only ever gains peers: nobody goes back.
    stage1 = [counts[1] for counts in result.peers_per_stage]
    assert stage1 == sorted(stage1)
    assert result.mean_throughput(100.0) > 1.6 * static.mean_throughput(100.0)


def test_rebalancing_under_churn_does_not_oscillate():
    config = SimConfig(
        num_stages=3,
        initial_peers_per_stage=(14, 4, 6),
        peer_speed_min=1.0,
        peer_speed_max=6.0,
        num_trainers=4,
        microbatches_in_flight=8,
        microbatch_size=8,
        duration_s=900.0,
        balance=RebalanceConfig(period_s=15.0, cooldown_periods=2, min_gain=0.1),
        seed=5,
    )
    result = simulate(config)
    assert result.num_moves >= 3
    visited: dict[str, list[int]] = {}
    for move in result.moves:
        visited.setdefault(move.peer_id, [move.from_stage]).append(move.to_stage)
    for peer, stages in visited.items():
        assert len(stages) == len(set(stages)), f"{peer} went back and forth: {stages}"
    # Settled: the last third of the run has no move.
    assert all(m.time_s < 600.0 for m in result.moves)
    capacities = result.capacity_per_stage[-1]
    assert min(capacities) > 0.7 * max(capacities)


def test_arrivals_and_deaths_keep_every_stage_served():
    config = SimConfig(
        num_stages=3,
        num_peers=30,
        num_trainers=2,
        microbatches_in_flight=8,
        microbatch_size=8,
        duration_s=600.0,
        arrival_rate_per_s=0.05,
        mean_lifetime_s=600.0,
        seed=2,
        balance=RebalanceConfig(period_s=30.0),
    )
    result = simulate(config)
    assert result.peers_arrived > 10 and result.peers_died > 10
    assert all(min(counts) >= 1 for counts in result.peers_per_stage)
    assert (
        result.microbatches_started == result.microbatches_completed + result.microbatches_in_flight
    )


def test_same_seed_same_run():
    config = dataclasses.replace(imbalanced(rebalance=True), duration_s=120.0)
    first, second = simulate(config), simulate(config)
    assert first == second


def test_config_validation():
    with pytest.raises(ValueError, match="num_stages must be an int >= 1, got 0"):
        SimConfig(num_stages=0)
    with pytest.raises(
        ValueError, match=r"peer_speed_max \(1.0\) must be >= peer_speed_min \(2.0\)"
    ):
        SimConfig(peer_speed_min=2.0, peer_speed_max=1.0)
    with pytest.raises(ValueError, match="initial_peers_per_stage has 3 entries for num_stages=2"):
        SimConfig(num_stages=2, initial_peers_per_stage=(1, 1, 1))
    with pytest.raises(ValueError, match="peer_speeds has 1 entries for 2 initial peers"):
        SimConfig(num_stages=2, initial_peers_per_stage=(1, 1), peer_speeds=(1.0,))
    with pytest.raises(ValueError, match="hits stage 5 but num_stages=2"):
        SimConfig(num_stages=2, preemptions=(Preemption(time_s=1.0, stage=5, fraction=0.5),))
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 1.5"):
        Preemption(time_s=1.0, stage=0, fraction=1.5)
    with pytest.raises(ValueError, match="TIME_S:STAGE:FRACTION"):
        Preemption.parse("12:1")


def test_main_prints_a_table(capsys):
    status = main(
        [
            "--num-stages",
            "2",
            "--num-peers",
            "6",
            "--duration-s",
            "120",
            "--num-trainers",
            "2",
            "--microbatches-in-flight",
            "4",
            "--microbatch-size",
            "8",
            "--preempt",
            "30:1:0.5",
            "--stage-costs",
            "1",
            "2",
            "--compare",
            "--table-every-s",
            "60",
            "--period-s",
            "20",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "| 60 |" in out and "| 120 |" in out
    assert "rebalancing: mean" in out and "static: mean" in out


def test_main_reports_bad_numbers(capsys):
    assert main(["--num-stages", "2", "--stage-costs", "1", "0"]) == 2
    assert "stage_costs must all be finite and > 0" in capsys.readouterr().err


def test_format_table_has_a_row_per_interval():
    result = simulate(dataclasses.replace(imbalanced(rebalance=True), duration_s=120.0))
    table = format_table({"run": result}, 40.0)
    assert table.count("\n") == 1 + 3  # header, separator, rows at 40, 80, 120
