"""A trainer in lockstep learns of a stage's step from its close of the batch: ``CloseBatch`` with
``wait_for_step_s`` is answered once the replica has stepped on the batch (or when the wait is over), so the trainer
does not ask every replica again while the stage steps. A real averaging replica in this process, on a real DHT,
closed through the trainer's own StageSteps."""

from __future__ import annotations

import math

import pytest
from livepeers import averaging_replicas, live_record, one_microbatch

from swarm.errors import SwarmError
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
