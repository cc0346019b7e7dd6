"""Replicas of a stage that average (--average, hivemind) train one model: they all-reduce gradients and step
together on exactly one global batch, and a peer that joins downloads the stage's state. (How the swarm
converges next to the same model in one process is bench/convergence.py's job: see its result file.)"""
from __future__ import annotations

import re
import time

import pytest
import torch

from conftest import ask_peers

pytestmark = pytest.mark.slow

RUN_ID = "replicas"
FLAGS = ["--preset", "tiny", "--target-batch-size", "64", "--average", "--matchmaking-s", "0.5", "--heartbeat-s", "0.5",
         "--ttl-s", "3", "--no-rebalance"]
STEPS = 8


def _wait_for_step(endpoints, step: int, timeout_s: float = 60.0) -> list[int]:
    """Poll the replicas until each has taken optimizer step ``step``; return their steps."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = ask_peers(endpoints, lambda c: c.info(RUN_ID, timeout_s=10))
        steps = [info.step for info in infos]
        if min(steps) >= step or time.monotonic() > deadline:
            return steps
        time.sleep(0.2)


def _assert_same_state(endpoints, step: int) -> None:
    states = ask_peers(endpoints, lambda c: c.get_state(RUN_ID, timeout_s=30))
    reference = states[0].tensors
    assert any(name.startswith("param/") for name in reference)
    for state in states:
        assert state.meta.step == step
        for name, tensor in reference.items():
            # Codec none on fp32: the replicas apply the same averaged gradient up to summation order.
            torch.testing.assert_close(state.tensors[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_replicas_agree_and_a_newcomer_loads_the_same_state(local_swarm):
    first = local_swarm.peer("s0", 0, *FLAGS, run_id=RUN_ID, wait=False)
    replicas = [local_swarm.peer(f"s1-{i}", 1, *FLAGS, run_id=RUN_ID, wait=False) for i in range(2)]
    local_swarm.wait_ready(first)
    endpoints = [local_swarm.wait_ready(p) for p in replicas]
    trainer = local_swarm.group.swarm("trainer", "train", "--run-id", RUN_ID, *local_swarm.initial_peers,
                                      "--steps", str(STEPS), "--microbatch-size", "8", "--in-flight", "4",
                                      "--max-batches-ahead", "2", "--eval-every-steps", "0", "--eval-batches", "2",
                                      "--log-every-s", "0")
    assert trainer.popen.wait(timeout=300) == 0, trainer.log_path.read_text()[-3000:]
    # One optimizer step per global batch the trainer sent: no batch split or merged, none lost.
    assert _wait_for_step(endpoints, STEPS) == [STEPS] * 2
    _assert_same_state(endpoints, STEPS)
    for proc in replicas:  # they averaged with each other, never stepped alone on their own gradients
        assert not [line for line in proc.lines if re.search("stepped without its peers|skipped its step|Traceback", line)], proc.name
    infos = ask_peers(endpoints, lambda c: c.info(RUN_ID, timeout_s=10))
    assert all(info.microbatches_applied > 0 for info in infos), [i.microbatches_applied for i in infos]
    assert sum(info.microbatches_applied for info in infos) == STEPS * 64 // 8
    # A third replica joins: it downloads parameters and optimizer state before it serves.
    newcomer = local_swarm.peer("s1-new", 1, *FLAGS, run_id=RUN_ID)
    assert newcomer.wait_for(r"state downloaded from its peers: now at step (\d+)", timeout_s=5).group(1) == str(STEPS)
    _assert_same_state([*endpoints, local_swarm.wait_ready(newcomer)], STEPS)
