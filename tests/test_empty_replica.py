"""A replica that holds none of a batch (it joined mid-batch, or got no microbatch of it) and whose batch the trainer
has not closed yet does not look for the step's all-reduce group: it could take the place of a replica that holds
samples in a group sized by the trainer's count, which had not counted it yet (bench/soak.py: a newcomer averaged 0
samples with one peer while the third, holding 24 of the batch's 32, was left out and lost them). The replicas
holding the batch average it together; the empty one takes their state. Three real averaging replicas in this
process, on a real DHT, in a run whose batch fills by samples (the soak's)."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
from livepeers import (
    CLOSE_DRIVEN_RUN,
    STEP0_LINE,
    B,
    assert_one_state,
    averaging_replicas,
    one_microbatch,
    until,
)

pytestmark = pytest.mark.integration

FULL_AT_TWO = dataclasses.replace(CLOSE_DRIVEN_RUN, target_batch_size=2 * B)


def test_a_replica_holding_none_of_the_batch_waits_for_its_close_before_looking_for_a_group(
    loop_thread, boot, caplog
):
    caplog.set_level(logging.DEBUG, logger="swarm.averaging.optimizer")

    async def body():
        replicas = await averaging_replicas(
            3, "empty0", boot, run=FULL_AT_TWO, matchmaking_s=1.0, group_wait_s=4.0
        )
        *holders, empty = replicas
        # Holds the first holder's compute thread, so it takes no step check: the holders would otherwise average
        # the full batch between two reads of the empty replica's progress records, which then never show it full
        # (the empty replica is behind at once and loads their state: one run in four failed that way).
        gate = threading.Event()
        try:
            await one_microbatch(holders[0], 0)
            holders[0]._worker.submit(gate.wait)
            await one_microbatch(holders[1], 1)
            # the batch is full by the stage's records: every replica sees it, the empty one too
            await until(
                lambda: (
                    empty.executor.optimizer.opt.tracker.global_progress.samples_accumulated
                    == 2 * B
                ),
                "the empty replica sees the batch full",
            )
            gate.set()
            # the trainer's count, taken before the empty replica was listed: the two holders
            holders[0].executor.close_batch(0, replicas=2)
            # the batch being full by samples, the holder may look before its close, or even have formed its group
            await until(
                lambda: (
                    holders[0].executor.optimizer.opt.scheduled_grads is not None
                    or holders[0].executor.step == 1
                ),
                "the first holder looks for a group",
            )
            assert empty.executor.optimizer.opt.scheduled_grads is None, (
                "a replica holding none of the batch, not closed yet, looks for a group"
            )
            holders[1].executor.close_batch(0, replicas=2)
            await until(lambda: all(p.executor.step == 1 for p in holders), "the holders step")
            empty.executor.close_batch(0, replicas=3)
            await until(lambda: empty.executor.step == 1, "the empty replica takes their state")
            await assert_one_state(replicas)
        finally:
            gate.set()
            for peer in replicas:
                await peer.shutdown()

    loop_thread.run(body(), timeout_s=300)  # three averaging peers start slowly at load 40+
    steps = sorted(m.groups() for m in map(STEP0_LINE.search, caplog.messages) if m)
    # both holders' samples are in the step: the step averaged the whole batch
    assert steps.count(("averaged", str(B))) == 2, steps
