"""A trainer in lockstep learns of a stage's step from its close of the batch: ``CloseBatch`` with
``wait_for_step_s`` is answered once the replica has stepped on the batch (or when the wait is over), so the trainer
does not ask every replica again while the stage steps. A real averaging replica in this process, on a real DHT,
closed through the trainer's own StageSteps."""

from __future__ import annotations

import asyncio
import math

import pytest
from livepeers import (
    NONE,
    averaging_replicas,
    hidden,
    live_record,
    meta,
    one_microbatch,
    tokens,
    until,
)

from swarm.errors import StepPending, SwarmError
from swarm.trainer.stagesteps import StageSteps
from swarm.transport.client import ClientPool, PeerClient

pytestmark = pytest.mark.integration

RUN_ID = "closewait"


def test_a_close_that_waits_is_answered_with_the_step_it_waited_for(loop_thread, boot):
    async def body():
        (peer,) = await averaging_replicas(1, RUN_ID, boot, matchmaking_s=1.0)
        clients = ClientPool()
        client = PeerClient(peer.address)
        try:
            record = live_record(peer)
            steps = StageSteps([{}, {record.peer_id: record}], clients, RUN_ID)
            # Nothing to step on yet: the wait ends at its bound with the step as it is.
            idle = (
                await client.close_batch(RUN_ID, 1, 0, 0, timeout_s=30, wait_for_step_s=0.5)
            ).step
            # Bad waits are refused with what to send; the replica goes on serving.
            refusals = []
            for bad in (-1.0, math.nan, math.inf):
                with pytest.raises(SwarmError, match="wait_for_step_s") as refused:
                    await client.close_batch(RUN_ID, 1, 0, 0, timeout_s=30, wait_for_step_s=bad)
                refusals.append(str(refused.value))
            await one_microbatch(peer, seed=0)
            # The record still says step 0, and nothing polls: only the close's answer can say step 1.
            await steps.close_batch([None, 0], wait_for_step_s=20.0)
            return idle, refusals, steps.stage_steps(), peer.executor.step
        finally:
            await client.close()
            await clients.close()
            await peer.shutdown()

    idle, refusals, known, step = loop_thread.run(body(), timeout_s=300)
    assert idle == 0
    assert len(refusals) == 3
    assert step == 1
    assert known == [0, 1]


def test_a_call_pinned_to_the_step_under_way_waits_for_it_and_runs_on_it(loop_thread, boot):
    """A trainer in lockstep sends a batch's first microbatches as soon as it has closed the batch before, pinned to
    the step its replicas are taking then: the replica holds such a call until it has stepped, and computes it on
    that step's parameters, not the step before's (off schedule). A step that does not come ends the wait at its
    bound: the call is refused (StepPending), nothing computed, for its trainer to send again once the stage has
    stepped."""
    run_id = RUN_ID + "-pinned"

    async def body():
        (peer,) = await averaging_replicas(1, run_id, boot, matchmaking_s=1.0)
        clients = ClientPool()
        client = PeerClient(peer.address)

        def pinned(microbatch_id: str, step: int, seed: int, **kw):
            return client.forward(
                meta(peer, microbatch_id, params_step=step, **kw),
                [("input", hidden(seed)), ("targets", tokens(seed))],
                NONE,
                timeout_s=30,
            )

        try:
            await one_microbatch(peer, seed=0)
            record = live_record(peer)
            # batch 1's first microbatch, pinned to step 1, reaches the replica before batch 0 is closed
            call = asyncio.ensure_future(
                pinned("next-batch", 1, seed=1, compute_loss=True, batch_step=1)
            )
            await until(
                lambda: call.done() or peer.steps.waiting > 0, "the call waits at the replica"
            )
            waited = not call.done()
            await StageSteps([{}, {record.peer_id: record}], clients, run_id).close_batch(
                [None, 0], wait_for_step_s=20.0
            )
            reply = await call
            await reply.committed
            on_time = (reply.meta.params_step, peer.executor.missed_param_steps)
            # a step the replica is not taking: the wait ends at its bound, nothing computed
            with pytest.raises(StepPending, match="pinned to step 5"):
                await pinned("far-ahead", 5, seed=2, eval_only=True)
            return waited, on_time, peer.executor.missed_param_steps
        finally:
            await client.close()
            await clients.close()
            await peer.shutdown()

    waited, on_time, late = loop_thread.run(body(), timeout_s=300)
    assert waited  # held at the replica until the step
    assert on_time == (1, 0)  # ran on step 1's parameters, none off schedule
    assert late == 0  # refused, not run off schedule
