"""Replicas whose all-reduce lost a groupmate mid-way (frozen or killed after the group formed) average again, once,
with a new group on the same gradients: they step on their samples together instead of each keeping its own
values where the groupmate's part should be, reloading, and losing the batch's samples (bench/soak.py: the
"received part of the all-reduce only" and "did not end within" steps). Three real averaging replicas in this
process, on a real DHT; the groupmate stalls because its compute thread is held, so it never hands its part in."""

from __future__ import annotations

import logging
import threading

import pytest
from hivemind.averaging.control import AveragingStage
from livepeers import (
    STEP0_LINE,
    B,
    assert_one_state,
    averaging_replicas,
    one_microbatch,
    until,
)

from swarm.peer.lifecycle import Peer

pytestmark = pytest.mark.integration


def _stage(peer: Peer):
    control = peer.executor.optimizer.opt.scheduled_grads
    return control.stage if control is not None else None


def test_replicas_whose_groupmate_stalls_mid_all_reduce_average_again_without_it(
    loop_thread, boot, caplog
):
    caplog.set_level(logging.DEBUG, logger="swarm.averaging.optimizer")

    async def body():
        replicas = await averaging_replicas(
            3,
            "regroup0",
            boot,
            matchmaking_s=1.0,
            group_wait_s=3.0,
            chunk_timeout_s=2.0,
            averaging_timeout_s=20.0,
        )
        *pair, stalled = replicas
        release = threading.Event()
        held = threading.Event()

        def hold_compute_thread():
            held.set()
            release.wait(120)

        try:
            for seed, peer in enumerate(replicas):
                await one_microbatch(peer, seed)
            stalled.executor.close_batch(0, replicas=3)
            await until(
                lambda: _stage(stalled) == AveragingStage.LOOKING_FOR_GROUP,
                "the stalled replica looks for its group",
            )
            # Its compute thread is held from now on: it joins the group (the averager's process does that) but
            # never hands its gradients in, as a replica frozen right after the group formed.
            blocked = stalled._worker.submit(hold_compute_thread)
            await until(held.is_set, "the stalled replica's compute thread is held")
            for peer in pair:
                peer.executor.close_batch(0, replicas=3)
            await until(lambda: all(p.executor.step == 1 for p in pair), "the pair steps")
            release.set()
            await until(lambda: blocked.done(), "the stalled replica's compute thread is free")
            await until(lambda: stalled.executor.step == 1, "the stalled replica takes their state")
            await assert_one_state(replicas)
        finally:
            release.set()
            for peer in replicas:
                await peer.shutdown()

    loop_thread.run(body(), timeout_s=300)  # three averaging peers start slowly at load 40+
    steps = [m.groups() for m in map(STEP0_LINE.search, caplog.messages) if m]
    assert any("looking for a new group" in m for m in caplog.messages), caplog.messages
    # the pair's step averaged both their microbatches; the stalled replica's part is the one left out
    assert sorted(steps)[:2] == [("averaged", str(B))] * 2, steps
    assert ("received part of the all-reduce only", str(B)) not in steps[:2], steps
