"""A caller frozen past its calls' deadlines (SIGSTOP, a machine swapping) wakes to failed calls it retries
elsewhere, never to a cancellation that ends it (swarm.transport.client.cancelled_at_its_deadline)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from livepeers import NONE, meta

from swarm.errors import SwarmError, TransportError
from swarm.transport.client import PeerClient, cancelled_at_its_deadline

pytestmark = pytest.mark.integration


class ExpiredCall:
    """What the reply reader asks of a grpc.aio call: how long until its deadline."""

    def __init__(self, remaining_s: float | None):
        self.remaining_s = remaining_s

    def time_remaining(self) -> float | None:
        return self.remaining_s


def test_a_cancellation_counts_as_the_calls_expiry_only_past_its_deadline_and_never_for_a_cancelled_task():
    async def verdicts():
        past, before, no_deadline = ExpiredCall(-0.5), ExpiredCall(3.0), ExpiredCall(None)
        own = [cancelled_at_its_deadline(call) for call in (past, before, no_deadline)]

        async def cancelled_task():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return cancelled_at_its_deadline(past)

        task = asyncio.create_task(cancelled_task())
        await asyncio.sleep(0)
        task.cancel()
        return own, await task

    own, while_cancelled = asyncio.run(verdicts())
    assert own == [True, False, False]
    # Python 3.11+ tells a task being cancelled apart; 3.10 goes by the deadline alone
    assert while_cancelled is (not hasattr(asyncio.Task, "cancelling"))


def test_a_caller_frozen_mid_call_past_its_deadline_gets_a_typed_failure(peers, loop_thread):
    """The whole process (peer and caller here) stops for 1 s while the request streams in 4-KiB frames under a
    0.3-s deadline: the call fails with a SwarmError the trainer retries elsewhere."""
    peer = peers("frozen", 1)
    x, targets = (
        torch.randn(64, 16, 32),
        torch.randint(0, 256, (64, 16)),
    )  # last stage, eval_only: a loss back

    async def frozen_call() -> SwarmError:
        client = PeerClient(peer.address, segment_bytes=4096)
        request = meta(peer, "frozen-0", eval_only=True)
        request.num_samples = 64
        asyncio.get_running_loop().call_later(
            0.01, time.sleep, 1.0
        )  # the process freezes mid-request
        try:
            with pytest.raises(SwarmError) as failed:
                await client.forward(
                    request, [("input", x), ("targets", targets)], NONE, timeout_s=0.3
                )
            return failed.value
        finally:
            await client.close()

    error = loop_thread.run(frozen_call())
    assert error.retry_elsewhere, error
    assert isinstance(error, TransportError) or "deadline" in str(error), error
