"""The simulator sizes its requests as the trainer sizes its calls (swarm.routing.work): in forward passes.

The trainer's router measures throughput in forward-pass units (a backward is twice a forward, the last stage's
call three times) so that one EMA and one deadline rule fit every kind of call. A simulator that sized every
request in samples would hand a backward the deadline of a forward: its peers then shed backwards the trainer
never sheds, and each one recomputes elsewhere at 1.5x the work (what held the 1,000-peer swarm's backwards).
"""

from __future__ import annotations

import pytest

from swarm.balance import RebalanceConfig
from swarm.routing.work import STEP_COST
from swarm.sim import SimConfig, simulate
from swarm.sim.engine import _Simulation  # the routers the run used: not part of SimResult


def run(config: SimConfig) -> _Simulation:
    sim = _Simulation(config)
    sim.run()
    return sim


def test_every_call_kind_measures_the_same_rate_in_forward_passes():
    # One microbatch at a time: no queue, so every round trip is the call's own compute plus two latencies.
    speeds = (4.0, 2.0)
    config = SimConfig(
        num_stages=2,
        initial_peers_per_stage=(1, 1),
        peer_speeds=speeds,
        num_trainers=1,
        microbatches_in_flight=1,
        microbatch_size=8,
        latency_s=0.001,
        duration_s=120.0,
        rebalance=False,
    )
    sim = run(config)
    router = sim.routers[0]
    for stage, speed in enumerate(speeds):
        (snapshot,) = router.snapshots(stage, sim.now)
        # Forwards (1 unit per sample) and backwards (2) at stage 0, forward + loss + backward (3) at stage 1:
        # all the same peer speed, so the EMA is that speed in forward passes, whatever kind came last.
        assert snapshot.throughput_ema == pytest.approx(speed * STEP_COST, rel=0.01)
        assert snapshot.num_successes > 10


def test_a_backward_follows_its_forward_to_a_draining_peer():
    # Stage 0 over-served (3 peers against 1): one moves. While it drains (10 s, far longer than a microbatch's
    # round trip), the backwards of the forwards it ran still go to it, as the trainer's records keep draining
    # peers for that: no backward is sent elsewhere to recompute.
    config = SimConfig(
        num_stages=2,
        initial_peers_per_stage=(3, 1),
        peer_speeds=(6.0,) * 4,
        num_trainers=1,
        microbatches_in_flight=6,
        microbatch_size=8,
        latency_s=0.002,
        duration_s=90.0,
        balance=RebalanceConfig(period_s=10.0, min_gain=0.1, cooldown_periods=1),
        drain_s=10.0,
        load_s=2.0,
        discovery_period_s=1.0,
    )
    result = simulate(config)
    assert result.num_moves >= 1 and result.peers_died == 0
    assert result.recomputes == 0


def test_replies_report_compute_so_routing_weighs_peers_by_speed_not_by_queue():
    # Two equal slow stage-0 peers before a fast last stage: 8 microbatches queue up at stage 0 and the round
    # trips there are mostly waiting. The simulated replies report their compute time, as the daemon's do
    # (ReplyMeta.compute_s), so the router's weight is each peer's speed with an empty queue (two latencies
    # per call included) while its round-trip EMA, which the deadlines use, is far lower.
    config = SimConfig(
        num_stages=2,
        initial_peers_per_stage=(2, 1),
        peer_speeds=(1.0, 1.0, 8.0),
        num_trainers=1,
        microbatches_in_flight=8,
        microbatch_size=8,
        latency_s=0.001,
        duration_s=300.0,
        rebalance=False,
    )
    sim = run(config)
    for snapshot in sim.routers[0].snapshots(0, sim.now):
        assert snapshot.throughput == pytest.approx(1.0 * STEP_COST, rel=0.02)
        assert snapshot.throughput_ema < 0.5 * snapshot.throughput
