"""Peers find the stage where they help most: on arrival, and by moving to the bottleneck over time."""

from __future__ import annotations

import re
import time

import pytest
from conftest import TEST_TRAINER, ask_peers, even_split_lower_bound

from swarm.coordinator.localswarm import served_stage

pytestmark = pytest.mark.swarm

# Replicas step on their own (--no-average): these tests measure where peers go and the throughput that
# follows, which an all-reduce every 16 samples would drown.
COMMON = [
    "--preset",
    "tiny",
    "--target-batch-size",
    "16",
    "--heartbeat-s",
    "0.5",
    "--ttl-s",
    "3",
    "--no-average",
]


@pytest.fixture
def swarm(measuring_swarm):
    return measuring_swarm


def test_arrivals_fill_the_empty_then_the_weakest_stage(swarm):
    # The two stages differ in cost (the last one holds the head and the loss), so the margins below are
    # wide: at least 40% between the capacities a newcomer compares.
    run = ["--no-rebalance", "--arrival-max-delay-s", "0.5"]
    # a weak peer: a third of the speed
    a = swarm.peer("arr-a", 0, *COMMON, *run, "--slowdown", "3", run_id="arrive", wait=False)
    assert served_stage(a) == 0

    def newcomer(name):
        proc = swarm.peer(name, None, *COMMON, *run, run_id="arrive", wait=False)
        return served_stage(proc), proc.wait_for(r"stage capacities \[.*\]", timeout_s=5).group(0)

    # Stage 1 is empty: the first newcomer must take it.
    stage, seen = newcomer("arr-b")
    assert stage == 1, seen
    # Stage 0 (one weak peer) is now the weaker stage: the next newcomer goes there ...
    stage, seen = newcomer("arr-c")
    assert stage == 0, seen
    # ... and then stage 1 (one peer against one and a third) is: the next goes back to stage 1.
    stage, seen = newcomer("arr-d")
    assert stage == 1, seen


PERIOD_S = 4.0
COOLDOWN_PERIODS = 3
MOVED = r"moved from stage (\d) to stage (\d)"


def test_bottleneck_gets_a_peer_without_oscillation(swarm):
    # Every peer emulates a device 10x slower (it sleeps 9x each call's compute, counted in CPU time), so a
    # stage's capacity is the sum of its peers' even when this machine is busy.
    # Global batches of 256: each optimizer step makes a peer drop the autograd graphs it holds (their backward
    # then recomputes the forward); with small batches that extra work would make stage 0 the bottleneck
    # after the move.
    flags = [
        *COMMON,
        "--target-batch-size",
        "256",
        "--slowdown",
        "10",
        "--period-s",
        str(PERIOD_S),
        "--cooldown-periods",
        str(COOLDOWN_PERIODS),
    ]

    def peer(name, stage):
        return swarm.peer(f"reb-{name}", stage, *flags, run_id="rebal", wait=False)

    # Phase 1: 2 + 1 peers. Stage 1 is the bottleneck, but moving a stage-0 peer would only swap the
    # bottleneck (no gain), so nobody moves.
    peers = [peer("a", 0), peer("b", 0), peer("d", 1)]
    endpoints = [swarm.wait_ready(p) for p in peers]
    trainer = swarm.trainer(
        "reb-trainer",
        run_id="rebal",
        **TEST_TRAINER,
        steps=10000,
        in_flight=16,
    )
    # Training runs once the last stage has counted samples (polling a remote counter: no event to wait on).
    deadline = time.monotonic() + 300
    while _samples_by_stage(endpoints)[1] == 0:
        assert trainer.alive() and time.monotonic() < deadline, trainer.lines[-20:]
        time.sleep(0.5)
    # Then 3 periods in which the peers see real throughputs and must not move: a wait for the move line
    # that has to time out (any peer's; the mover would be one of the stage-0 peers).
    for p in peers[:2]:
        assert not _next_move(p, within_s=1.5 * PERIOD_S), _moves(peers)
    assert not _moves(peers), ("a peer moved before the swarm was unbalanced", _moves(peers))
    # Phase 2: a third peer joins stage 0 (3 + 1): now a move pays off.
    peers.append(peer("c", 0))
    endpoints.append(swarm.wait_ready(peers[-1]))
    # One of the stage-0 peers moves to stage 1. No tighter deadline than the configuration gives: the old
    # peers may move at the next period, the newcomer after its cooldown; a move drains (at most the default
    # --drain-timeout-s, 30 s) and loads the stage's state. Twice that, on a busy machine.
    within_s = 2 * ((COOLDOWN_PERIODS + 2) * PERIOD_S + 30.0)
    mover = _first_to_move([peers[0], peers[1], peers[3]], within_s=within_s)
    assert mover is not None, (
        f"no peer moved to the bottleneck stage within {within_s:.0f}s",
        [line for p in peers for line in p.lines if "stage" in line],
    )
    assert _moves(peers) and re.search(MOVED, _moves(peers)[0]).groups() == ("0", "1"), _moves(
        peers
    )
    # The bottleneck stage gained capacity: the mover serves stage 1 and the trainer sends it work there.
    # Routing weighs both stage-1 peers by measured speed, and they are equal, so the mover's expected share
    # of stage-1 work is one half; it must get more than an even split's lower 3-sigma bound over the
    # microbatches counted (a routing that ignored the newcomer gives it none).
    at_move = _samples_by_peer(endpoints)
    # ... then 10 periods in which nobody moves again (no back and forth): waits for a second move that must
    # time out.
    assert not _next_move(mover, within_s=10 * PERIOD_S), _moves(peers)
    after = _samples_by_peer(endpoints)
    assert trainer.alive(), trainer.lines[-20:]
    swarm.group.stop("reb-trainer")
    assert len(_moves(peers)) == 1, _moves(peers)
    stage1 = {e: after[e][1] - (at_move[e][1] if at_move[e][0] == 1 else 0) for e in after}
    stage1 = {e: n for e, n in stage1.items() if after[e][0] == 1}
    mover_endpoint = endpoints[peers.index(mover)]
    assert set(stage1) == {mover_endpoint, endpoints[2]}, after
    microbatches = sum(stage1.values()) // 8
    assert microbatches >= 20, ("too little work after the move to compare shares", stage1)
    assert stage1[mover_endpoint] / sum(stage1.values()) >= even_split_lower_bound(microbatches), (
        stage1
    )


def _moves(peers) -> list[str]:
    return [line for p in peers for line in p.lines if re.search(MOVED, line)]


def _next_move(proc, *, within_s: float) -> bool:
    """Whether ``proc`` logs a move (after those it logged already) within ``within_s``: a wait on the
    event itself, which returns as soon as it happens."""
    seen = len(proc.lines)
    try:
        proc.wait_for(MOVED, timeout_s=within_s, after_line=seen)
    except TimeoutError:
        return False
    return True


def _first_to_move(procs, *, within_s: float):
    """The first of ``procs`` to log a move within ``within_s`` (None if none does); waits on each in turn in
    short slices, so it returns soon after the move, whichever peer makes it."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for proc in procs:
            if any(re.search(MOVED, line) for line in proc.lines) or _next_move(proc, within_s=0.3):
                return proc
    return None


def _samples_by_peer(endpoints) -> dict[str, tuple[int, int]]:
    """endpoint -> (stage it serves, samples counted in its gradients since it began serving that stage)."""
    infos = ask_peers(endpoints, lambda client: client.info("rebal", timeout_s=10))
    return {e: (info.stage, info.samples_applied) for e, info in zip(endpoints, infos)}


def _samples_by_stage(endpoints) -> dict[int, int]:
    out = {0: 0, 1: 0}
    for stage, samples in _samples_by_peer(endpoints).values():
        out[stage] += samples
    return out
