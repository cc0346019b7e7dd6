"""Faults on purpose: killed, frozen, slow and draining peers cost throughput, never data."""

from __future__ import annotations

import signal
import time

import pytest
from conftest import SOLO_PEER_FLAGS, TEST_TRAINER, ask_peers, drain_peer, even_split_lower_bound

from swarm.coordinator.localswarm import finished

pytestmark = pytest.mark.swarm

# Fast failure detection for tests: announce often, expire quickly. These tests measure routing around
# faults, so replicas step on their own; tests/test_averaging.py covers faults of averaging replicas.
PEER_FLAGS = [*SOLO_PEER_FLAGS, "--heartbeat-s", "0.5", "--ttl-s", "3"]


@pytest.fixture
def swarm(measuring_swarm):
    return measuring_swarm


def start_peers(swarm, run_id, layout: dict[str, list[str]]) -> dict[str, str]:
    """layout: name -> extra flags (name 'sK-...' serves stage K). Returns name -> endpoint."""
    procs = {
        name: swarm.peer(
            f"{run_id}-{name}", int(name[1]), *PEER_FLAGS, *flags, run_id=run_id, wait=False
        )
        for name, flags in layout.items()
    }
    return {name: swarm.wait_ready(proc) for name, proc in procs.items()}


def start_trainer(swarm, run_id, *, steps, in_flight=4, activations="relayed"):
    return swarm.trainer(
        f"{run_id}-trainer",
        run_id=run_id,
        **TEST_TRAINER,
        steps=steps,
        in_flight=in_flight,
        eval_batches=2,
        activations=activations,
    )


# Every fault test runs with activations relayed through the trainer and pushed peer to peer (swarm.trainer.push):
# the same faults, the same guarantees.
ACTIVATIONS = pytest.mark.parametrize("activations", ["relayed", "push"])


def infos(endpoints, run_id):
    return dict(
        zip(
            endpoints,
            ask_peers(endpoints.values(), lambda client: client.info(run_id, timeout_s=10)),
        )
    )


@ACTIVATIONS
def test_kill_and_freeze_mid_run(swarm, activations):
    run_id = f"killfreeze-{activations}"
    endpoints = start_peers(swarm, run_id, {"s0-a": [], "s0-b": [], "s1-a": [], "s1-b": []})
    trainer = start_trainer(swarm, run_id, steps=40, activations=activations)
    trainer.wait_for(r"^step 5/", timeout_s=300)
    swarm.group.procs[f"{run_id}-s0-b"].signal(signal.SIGKILL)  # gone, with its cached microbatches
    trainer.wait_for(r"^step 12/", timeout_s=300)
    frozen = swarm.group.procs[f"{run_id}-s1-b"]
    frozen.signal(signal.SIGSTOP)  # hangs: its calls never answer until their deadline
    try:
        result = finished(trainer, timeout_s=600)
    finally:
        frozen.signal(signal.SIGCONT)
    # 40 steps x 2 microbatches, every one completed
    assert result.microbatches == result.microbatches_started == 80
    assert result.failed_calls > 0  # the faults really hit calls in flight
    assert result.final_loss < 0.85 * result.initial_loss

    # Exactly once: the stage-1 replicas (one of them frozen and resumed) counted each microbatch once.
    # The resumed peer first works off the calls queued while frozen; their callers gave up, so no
    # commit arrives and nothing of them counts. Wait (bounded) for that backlog to clear.
    stage1 = {k: v for k, v in endpoints.items() if k.startswith("s1")}
    deadline = time.monotonic() + 60
    while (states := infos(stage1, run_id)) and any(i.in_flight for i in states.values()):
        assert time.monotonic() < deadline, states
        time.sleep(0.2)  # polling a remote counter: there is no event to wait on
    # Never less: a commit the frozen peer could not confirm was asked again (Commit RPC) until its hold was
    # over, then its gradient computed again at the other replica. Never twice, but for the one case the
    # trainer reports as unconfirmed: the peer counted it in the instant before it froze, so the trainer could
    # not learn it had, and it comes back.
    applied = sum(i.microbatches_applied for i in states.values())
    assert 80 <= applied <= 80 + result.unconfirmed_commits, (applied, result, states)
    assert infos({"s0-a": endpoints["s0-a"]}, run_id)["s0-a"].microbatches_applied <= 80


@ACTIVATIONS
def test_commits_lost_in_every_way_count_exactly_once(swarm, activations):
    run_id = f"lostcommit-{activations}"
    # Both peers lose 60% of the commits sent in calls (push: of the first commits, sent by the Commit RPC), a third
    # each way: before applying them (a broken stream), after (the confirmation lost), or as if they came after the
    # hold (the gradients dropped).
    lossy = ["--lose-commit-probability", "0.6"]
    endpoints = start_peers(swarm, run_id, {"s0-a": lossy, "s1-a": lossy})
    result = finished(
        start_trainer(swarm, run_id, steps=24, activations=activations), timeout_s=600
    )
    assert result.microbatches == result.microbatches_started == 48
    # Every lost commit was settled by asking the peer again: none stayed unknown.
    assert result.unconfirmed_commits == 0 and result.failed_calls == 0
    final = infos(endpoints, run_id)
    # Exactly once at each stage: the first two ways through the Commit RPC, the third by computing the
    # gradient again (the trainer gives up after 9 computations, 0.2^9 per microbatch). Each way really
    # happened: a peer with no late commit or no dropped gradient has probability 0.8^48 < 3e-5.
    assert [final[name].microbatches_applied for name in ("s0-a", "s1-a")] == [48, 48], final
    assert all(final[name].late_commits > 0 for name in final), final
    assert all(final[name].gradients_dropped > 0 for name in final), final


@ACTIVATIONS
def test_slow_peer_gets_less_work_and_no_microbatch_is_lost(swarm, activations):
    run_id = f"slow-{activations}"
    # Stage 0 has a peer at a quarter speed and one 4x slower than it. Slowdown sleeps a multiple of each call's
    # CPU time, so the ratio of the two peers' speeds holds on a loaded machine, where absolute speeds do not.
    endpoints = start_peers(
        swarm, run_id, {"s0-fast": ["--slowdown", "4"], "s0-slow": ["--slowdown", "16"], "s1-a": []}
    )
    # Enough microbatches in flight that both stage-0 peers always have work queued.
    trainer = start_trainer(swarm, run_id, steps=60, in_flight=16, activations=activations)
    result = finished(trainer, timeout_s=600)
    assert result.microbatches == result.microbatches_started == 120
    final = infos(endpoints, run_id)
    applied = {name: final[name].microbatches_applied for name in ("s0-fast", "s0-slow")}
    # Exactly once across the two replicas of stage 0 (nothing failed here), and both served.
    assert sum(applied.values()) == 120 and min(applied.values()) > 0, applied
    # Routing weighs peers by measured speed: the slow peer's expected share is about 1/5. What is checked is
    # the ordering, with a margin from the counts: its share is below what a speed-blind, even split gives but
    # with probability < 0.14% (0.5 - 3 sigma of 120 fair draws = 0.363); its expected 0.2 sits 4.5 sigma (of
    # 120 draws at p = 0.2) below that bound. How close the share comes to the measured capacities, and the
    # throughput the swarm keeps, are speeds on a shared machine: not checked here (a ±0.08 band around the
    # capacity share, ~1.8 sigma of ~80 draws, failed by chance on a loaded machine); bench/faults.py measures them.
    share = applied["s0-slow"] / sum(applied.values())
    assert share < even_split_lower_bound(sum(applied.values())), applied


@ACTIVATIONS
def test_sigterm_drains_without_failed_requests(swarm, activations):
    run_id = f"drain-{activations}"
    start_peers(swarm, run_id, {"s0-a": [], "s0-b": [], "s1-a": [], "s1-b": []})
    trainer = start_trainer(swarm, run_id, steps=30, activations=activations)
    trainer.wait_for(r"^step 5/", timeout_s=300)
    leaving = swarm.group.procs[f"{run_id}-s0-b"]
    drain_peer(leaving)
    result = finished(trainer, timeout_s=600)
    assert result.microbatches == result.microbatches_started == 60
    assert result.failed_calls == 0 and result.unconfirmed_commits == 0
