"""Peers find the stage where they help most: on arrival, and by moving to the bottleneck over time."""
from __future__ import annotations

import contextlib
import json
import re
import time
from datetime import datetime

import pytest

pytestmark = pytest.mark.slow

# Replicas step on their own (--no-average): these tests measure where peers go and the throughput that
# follows, which an all-reduce every 16 samples would drown.
COMMON = ["--preset", "tiny", "--target-batch-size", "16", "--heartbeat-s", "0.5", "--ttl-s", "3", "--no-average"]


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
    a = swarm.peer("arr-a", 0, *COMMON, *run, "--slowdown", "3", run_id="arrive")  # a weak peer: a third of the speed
    assert served_stage(swarm, a) == 0

    def newcomer(name):
        proc = swarm.group.swarm(name, "peer", "--run-id", "arrive", *swarm.initial_peers, *COMMON, *run)
        return served_stage(swarm, proc), proc.wait_for(r"stage capacities \[.*\]", timeout_s=5).group(0)

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


def test_bottleneck_gets_a_peer_without_oscillation(swarm, tmp_path):
    period = 4.0
    # Every peer emulates a device 10x slower (it sleeps 9x each call's compute time), so the 2-core
    # machine is not the limit and stage capacity really is the sum of its peers.
    # Global batches of 64: each optimizer step makes the peers drop the autograd graphs they hold (their
    # backward then recomputes the forward), and with small batches that extra work would make stage 0 the
    # bottleneck after the move.
    flags = [*COMMON, "--target-batch-size", str(BATCH), "--slowdown", "10", "--period-s", str(period),
             "--cooldown-periods", "3"]

    def peer(name, stage):
        return swarm.peer(f"reb-{name}", stage, *flags, run_id="rebal", wait=False)

    # Phase 1: 2 + 1 peers. Stage 1 is the bottleneck, but moving a stage-0 peer would only swap the
    # bottleneck (no gain), so nobody moves; this measures the 1-peer bottleneck's throughput.
    peers = [peer("a", 0), peer("b", 0), peer("d", 1)]
    for p in peers:
        swarm.wait_ready(p)
    metrics = tmp_path / "metrics.jsonl"
    trainer = swarm.group.swarm("reb-trainer", "train", "--run-id", "rebal", *swarm.initial_peers, "--steps", "10000",
                                "--microbatch-size", "8", "--in-flight", "16", "--eval-every-steps", "0",
                                "--log-every-s", "0", "--metrics-path", str(metrics))
    trainer.wait_for(r"^step 1/", timeout_s=120)
    started_at = _steps(metrics)[0]["wall_time"]
    _train_until(trainer, metrics, started_at + 5 * period)
    # Phase 2: a third peer joins stage 0 (3 + 1): now a move pays off.
    peers.append(peer("c", 0))
    swarm.wait_ready(peers[-1])
    joined_at = time.time()
    # Within 3 periods one of the stage-0 peers moves to stage 1 ...
    moved = MOVED.format(0, 1)
    deadline = joined_at + 3 * period + 15  # 3 periods, plus the drain and state load of the move
    mover = None
    while mover is None:
        assert time.time() < deadline, ("no peer moved to the bottleneck stage within 3 periods",
                                        [line for p in peers for line in p.lines if "stage" in line])
        for p in (peers[0], peers[1], peers[3]):
            with contextlib.suppress(TimeoutError):
                p.wait_for(moved, timeout_s=0.3)
                mover = p
    moved_at = _log_time(next(line for line in mover.lines if re.search(moved, line)))
    # ... then 10 more periods in which nobody moves again (no back and forth).
    _train_until(trainer, metrics, moved_at + 10 * period)
    swarm.group.stop("reb-trainer")
    moves = [line for p in peers for line in p.lines if "moved from stage" in line]
    assert len(moves) == 1, moves
    steps = _steps(metrics)
    before = _rate(steps, started_at + period, joined_at)  # skip one period of routing warm-up
    after = _rate(steps, moved_at + period, None)  # one period to settle (routing learns the newcomer)
    assert after >= 1.5 * before, (before, after)


def _train_until(trainer, metrics, wall_time: float) -> None:
    """Block until the trainer has recorded a step at or after ``wall_time`` (each step prints a line)."""
    while _steps(metrics)[-1]["wall_time"] < wall_time:
        trainer.wait_for(r"^step \d+/", timeout_s=60, after_line=len(trainer.lines))


MOVED = r"moved from stage {} to stage {}"
BATCH = 64  # samples per global batch in the bottleneck test


def _steps(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line]


def _rate(steps, t_from, t_to) -> float:
    """Samples per second between two wall-clock times, from the trainer's per-step records."""
    chosen = [r for r in steps if r["wall_time"] >= t_from and (t_to is None or r["wall_time"] <= t_to)]
    assert len(chosen) >= 3, (t_from, t_to, len(steps))
    return (len(chosen) - 1) * BATCH / (chosen[-1]["wall_time"] - chosen[0]["wall_time"])
