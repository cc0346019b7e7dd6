"""A replica that looks for its step's all-reduce group after the matchmaking time (its compute thread was busy, its
view of the stage lagged, it heard of the batch's close late) still gets its samples into the stage's step: the
group waits for every replica the trainer counted or the stage's progress records show at that step, up to
``group_wait_s``, instead of assembling at the end of the matchmaking time with whoever joined (the late replica
then loaded its peers' state and its samples of the batch were lost: 96 of 2,080 per stage in bench/soak.py).
Three real averaging replicas in this process, on a real DHT."""

from __future__ import annotations

import asyncio
import logging

import pytest
from livepeers import (
    STEP0_LINE,
    B,
    assert_one_state,
    averaging_replicas,
    looking_for_group,
    one_microbatch,
    until,
)

pytestmark = pytest.mark.integration

MATCHMAKING_S = 1.0


def test_a_replica_that_looks_for_its_group_late_still_averages_its_samples(
    loop_thread, boot, caplog
):
    caplog.set_level(logging.DEBUG, logger="swarm.averaging.optimizer")

    async def body():
        replicas = await averaging_replicas(
            3, "late0", boot, matchmaking_s=MATCHMAKING_S, group_wait_s=20.0
        )
        early, late = replicas[:2], replicas[2]
        try:
            for seed, peer in enumerate(replicas):
                await one_microbatch(peer, seed)
            # The trainer's count misses the late replica (its record expired in the trainer's view between two
            # heartbeats): the stage's progress records, where it reported its samples, still count it.
            await until(
                lambda: all(p.executor.optimizer.opt.tracker.peers_at_epoch == 3 for p in early),
                "the early two see the late replica's progress record",
            )
            for peer in early:
                peer.executor.close_batch(0, replicas=2)
            await until(
                lambda: all(looking_for_group(p) for p in early), "the early two look for a group"
            )
            # The late replica hears of the close well after the early two's matchmaking time: deliberate lateness,
            # the fault under test (hivemind's leader would have assembled without it by then).
            await asyncio.sleep(3 * MATCHMAKING_S)
            assert all(p.executor.step == 0 for p in early), "the early two stepped without it"
            late.executor.close_batch(0, replicas=2)
            await until(lambda: all(p.executor.step == 1 for p in replicas), "all three step")
            await assert_one_state(replicas)
        finally:
            for peer in replicas:
                await peer.shutdown()

    loop_thread.run(body(), timeout_s=300)  # three averaging peers start slowly at load 40+
    steps = [m.groups() for m in map(STEP0_LINE.search, caplog.messages) if m]
    # each replica took step 0 in the group with its own samples: the step averaged all 3 microbatches
    assert sorted(steps) == [("averaged", str(B))] * 3, steps
    assert not [m for m in caplog.messages if "behind its peers" in m]
