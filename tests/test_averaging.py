"""Replicas of a stage that average (--average, hivemind) train one model: they all-reduce gradients and step
together on exactly one global batch, and a peer that joins downloads the stage's state. (test_parity.py checks
what they learn against one process.)"""

from __future__ import annotations

import signal
import time

import pytest
import torch
from conftest import TEST_TRAINER, ask_peers

from swarm.coordinator.localswarm import finished

pytestmark = pytest.mark.swarm

RUN_ID = "replicas"
FLAGS = [
    "--preset",
    "tiny",
    "--target-batch-size",
    "64",
    "--average",
    "--matchmaking-s",
    "1.0",
    "--heartbeat-s",
    "0.5",
    "--ttl-s",
    "3",
    "--no-rebalance",
]


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


STEPS = 16


def test_replicas_agree_and_one_that_joins_mid_run_ends_in_the_same_state(local_swarm):
    """Two replicas fed different microbatches train as one; a third joins mid-run, downloads the stage's state
    before it serves, takes part in the all-reduce, and ends with the same parameters."""
    first = local_swarm.peer("s0", 0, *FLAGS, run_id=RUN_ID, wait=False)
    replicas = [local_swarm.peer(f"s1-{i}", 1, *FLAGS, run_id=RUN_ID, wait=False) for i in range(2)]
    local_swarm.wait_ready(first)
    endpoints = [local_swarm.wait_ready(p) for p in replicas]
    trainer = local_swarm.trainer(
        "trainer",
        run_id=RUN_ID,
        **TEST_TRAINER,
        steps=STEPS,
        in_flight=4,
        max_batches_ahead=2,
        eval_batches=2,
    )
    trainer.wait_for(r"^step 2/", timeout_s=300)
    # The trainer's step counts batches sent, not the stage's steps: on a loaded machine stage 1's first all-reduce
    # can still run, and a newcomer that attaches then has no later step to download. Start it once there is one.
    assert min(_wait_for_step(endpoints, 1, timeout_s=300)) >= 1
    newcomer = local_swarm.peer("s1-new", 1, *FLAGS, run_id=RUN_ID, wait=False)
    trainer.wait_for(r"^step 6/", timeout_s=300)
    # on a busy machine the newcomer may still be starting: hold the run until it serves
    trainer.signal(signal.SIGSTOP)
    try:
        endpoints.append(local_swarm.wait_ready(newcomer))
    finally:
        trainer.signal(signal.SIGCONT)
    joined_at = int(
        newcomer.wait_for(r"state downloaded from its peers: now at step (\d+)", timeout_s=5).group(
            1
        )
    )
    assert 0 < joined_at < STEPS - 4
    finished(trainer, timeout_s=300)
    # One optimizer step per global batch the trainer sent: no batch split or merged, none lost.
    assert _wait_for_step(endpoints, STEPS) == [STEPS] * 3
    _assert_same_state(endpoints, STEPS)
    infos = ask_peers(endpoints, lambda c: c.info(RUN_ID, timeout_s=10))
    assert all(info.microbatches_applied > 0 for info in infos), [
        i.microbatches_applied for i in infos
    ]
    assert sum(info.microbatches_applied for info in infos) == STEPS * 64 // 8
