"""The state a replica hands a newcomer (or a replica behind) is the state of one step. hivemind's averager process
streams it seconds after the replica's background thread read it, through shared memory: on the CPU, what it read
must be a copy, or the replica's next steps write into the tensors being streamed and the replica that loads them
holds parameters of two steps (CI saw two replicas of a stage end a run with different digests after one loaded its
peer's state while the peer stepped). A real averaging replica in this process, on a real DHT."""

from __future__ import annotations

import pytest
import torch
from livepeers import averaging_replicas, one_microbatch, until_step

pytestmark = pytest.mark.integration


def test_the_state_handed_out_is_a_copy_that_later_steps_leave_alone(loop_thread, boot):
    async def body():
        (peer,) = await averaging_replicas(1, "snapshot", boot, matchmaking_s=1.0)
        try:
            # two steps alone: after the first, the optimizer holds statistics as well as parameters
            for step in (0, 1):
                await one_microbatch(peer, step, batch_step=step)
                peer.executor.close_batch(step, replicas=1)
                await until_step(peer, step + 1, "it steps alone")
            averager = peer.executor.optimizer.opt.state_averager
            # what hivemind's thread that serves the state calls (on this replica's side)
            metadata, tensors, _ = await peer._worker.compute_urgent(averager.get_current_state)
            assert metadata["epoch"] == 2
            at_step2 = [t.clone() for t in tensors]
            await one_microbatch(peer, 2, batch_step=2)
            peer.executor.close_batch(2, replicas=1)
            await until_step(peer, 3, "it steps on")
            _, now, _ = await peer._worker.compute_urgent(averager.get_current_state)
            # the step changed the parameters and the optimizer's statistics ...
            assert any(not torch.equal(a, b) for a, b in zip(now, at_step2))
            # ... and none of what was handed out at step 2
            for i, (handed, want) in enumerate(zip(tensors, at_step2)):
                assert torch.equal(handed, want), (
                    f"tensor {i} of the state changed after it was handed out"
                )
        finally:
            await peer.shutdown()

    loop_thread.run(body(), timeout_s=300)
