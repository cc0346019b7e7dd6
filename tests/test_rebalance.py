"""Peers find the stage where they help most: on arrival, and by moving to the bottleneck over time."""

from __future__ import annotations

import contextlib
import re
import time
from datetime import datetime

import pytest
from conftest import ask_peers

pytestmark = pytest.mark.slow

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


def served_stage(swarm, proc) -> int:
    swarm.wait_ready(proc)
    return int(proc.wait_for(r"serves stage (\d+)", timeout_s=5).group(1))


def test_arrivals_fill_the_empty_then_the_weakest_stage(swarm):
    # The two stages differ in cost (the last one holds the head and the loss), so the margins below are
    # wide: at least 40% between the capacities a newcomer compares.
    run = ["--no-rebalance", "--arrival-max-delay-s", "0.5"]
    # a weak peer: a third of the speed
    a = swarm.peer("arr-a", 0, *COMMON, *run, "--slowdown", "3", run_id="arrive")
    assert served_stage(swarm, a) == 0

    def newcomer(name):
        proc = swarm.group.swarm(
            name, "peer", "--run-id", "arrive", *swarm.initial_peers, *COMMON, *run
        )
        return served_stage(swarm, proc), proc.wait_for(
            r"stage capacities \[.*\]", timeout_s=5
        ).group(0)

    # Stage 1 is empty: the first newcomer must take it.
    stage, seen = newcomer("arr-b")
    assert stage == 1, seen
    # Stage 0 (one weak peer) is now the weaker stage: the next newcomer goes there ...
    stage, seen = newcomer("arr-c")
    assert stage == 0, seen
    # ... and then stage 1 (one peer against one and a third) is: the next goes back to stage 1.
    stage, seen = newcomer("arr-d")
    assert stage == 1, seen


def _log_time(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_bottleneck_gets_a_peer_without_oscillation(swarm):
    period = 4.0
    # Every peer emulates a device 10x slower (it sleeps 9x each call's compute), so the 2-core machine is not
    # the limit and a stage's capacity really is the sum of its peers'.
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
        str(period),
        "--cooldown-periods",
        "3",
    ]

    def peer(name, stage):
        return swarm.peer(f"reb-{name}", stage, *flags, run_id="rebal", wait=False)

    # Phase 1: 2 + 1 peers. Stage 1 is the bottleneck, but moving a stage-0 peer would only swap the
    # bottleneck (no gain), so nobody moves; this measures the 1-peer bottleneck's throughput.
    peers = [peer("a", 0), peer("b", 0), peer("d", 1)]
    endpoints = [swarm.wait_ready(p) for p in peers]
    trainer = swarm.group.swarm(
        "reb-trainer",
        "train",
        "--run-id",
        "rebal",
        *swarm.initial_peers,
        "--steps",
        "10000",
        "--microbatch-size",
        "8",
        "--in-flight",
        "16",
        "--eval-every-steps",
        "0",
        "--log-every-s",
        "0",
    )
    deadline = time.monotonic() + 120
    # polling a remote counter: there is no event to wait on
    while _last_stage_samples(endpoints) == 0:
        assert trainer.alive() and time.monotonic() < deadline, trainer.lines[-20:]
        time.sleep(0.5)
    time.sleep(period)  # routing warm-up: the trainer measures its peers
    before = _last_stage_rate(endpoints, 4 * period)
    assert not _moves(peers), ("a peer moved before the swarm was unbalanced", _moves(peers))
    # Phase 2: a third peer joins stage 0 (3 + 1): now a move pays off.
    peers.append(peer("c", 0))
    endpoints.append(swarm.wait_ready(peers[-1]))
    joined_at = time.time()
    # Within 3 periods one of the stage-0 peers moves to stage 1 ...
    moved = MOVED.format(0, 1)
    deadline = joined_at + 3 * period + 15  # 3 periods, plus the drain and state load of the move
    mover = None
    while mover is None:
        assert time.time() < deadline, (
            "no peer moved to the bottleneck stage within 3 periods",
            [line for p in peers for line in p.lines if "stage" in line],
        )
        for p in (peers[0], peers[1], peers[3]):
            with contextlib.suppress(TimeoutError):
                p.wait_for(moved, timeout_s=0.3)
                mover = p
    moved_at = _log_time(next(line for line in mover.lines if re.search(moved, line)))
    # ... then 10 more periods in which nobody moves again (no back and forth); after one period to settle
    # (routing learns the newcomer), they measure the throughput.
    time.sleep(max(0.0, moved_at + period - time.time()))
    after = _last_stage_rate(endpoints, moved_at + 10 * period - time.time())
    assert trainer.alive(), trainer.lines[-20:]
    swarm.group.stop("reb-trainer")
    assert len(_moves(peers)) == 1, _moves(peers)
    assert after >= 1.5 * before, (before, after)


MOVED = r"moved from stage {} to stage {}"


def _moves(peers) -> list[str]:
    return [line for p in peers for line in p.lines if "moved from stage" in line]


def _last_stage_samples(endpoints) -> int:
    """Samples the last stage's peers have counted in their gradients: every microbatch completes there."""
    infos = ask_peers(endpoints, lambda client: client.info("rebal", timeout_s=10))
    return sum(info.samples_applied for info in infos if info.stage == 1)


def _last_stage_rate(endpoints, seconds: float) -> float:
    """The swarm's throughput (samples/s through the last stage) over a measurement window of ``seconds``,
    from the peers' own counters (a peer that moves starts a new count, so no window may span a move)."""
    t0, n0 = time.monotonic(), _last_stage_samples(endpoints)
    time.sleep(seconds)
    t1, n1 = time.monotonic(), _last_stage_samples(endpoints)
    return (n1 - n0) / (t1 - t0)
