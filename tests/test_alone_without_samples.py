"""A replica the trainer tells to step alone while it holds none of the batch (it joined, or came back, after the
trainer last counted the stage) must not step: a step on a zero gradient still moves its parameters (AdamW's
momentum and decay), leaving it at the same step as the replica that stepped on the batch with other parameters
(the compose demo's restarted peer ended so, 0.0063 apart). It waits, and takes that replica's state once it has
stepped. Two real averaging replicas in this process, on a real DHT."""

from __future__ import annotations

import asyncio
import time

import pytest
from livepeers import (
    MODEL,
    NONE,
    B,
    assert_same_tensors,
    get_state,
    hidden,
    meta,
    params,
    tokens,
)

from swarm.averaging.config import AveragingConfig
from swarm.config import RunConfig
from swarm.discovery.dht import DHTConfig
from swarm.peer.config import PeerConfig
from swarm.peer.lifecycle import Peer
from swarm.transport.client import PeerClient

pytestmark = pytest.mark.integration

# The batch never fills by samples: only the trainer's close (CloseBatch) makes the stage step.
RUN = RunConfig(model=MODEL, target_batch_size=64 * B, warmup_steps=0)


async def _until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)  # state another thread or process updates: poll with a deadline


def test_a_replica_told_to_step_alone_without_samples_waits_and_takes_its_peers_state(
    loop_thread, boot
):
    def config() -> PeerConfig:
        return PeerConfig(
            run_id="alone0",
            stage=1,
            rebalance=False,
            heartbeat_s=0.3,
            ttl_s=2.0,
            averaging=AveragingConfig(average=True, matchmaking_s=1.0, all_reduce="hivemind"),
            dht=DHTConfig(initial_peers=boot),
        )

    async def body():
        holder = await Peer.create(config(), run=RUN)
        empty = await Peer.create(config(), run=RUN)
        try:
            client = PeerClient(holder.address)
            try:  # the holder gets the batch's one microbatch
                reply = await client.forward(
                    meta(holder, "mb0", compute_loss=True, batch_step=0),
                    [("input", hidden(0)), ("targets", tokens(0))],
                    NONE,
                    timeout_s=30,
                )
                await reply.committed
            finally:
                await client.close()
            tracker = empty.executor.optimizer.opt.tracker
            await _until(
                lambda: tracker.global_progress.samples_accumulated >= B,
                "the empty replica sees the holder's samples in the stage's progress",
            )
            # The trainer closes batch 0 at the empty replica first, counting one replica of the stage.
            empty.executor.close_batch(0, replicas=1)
            stepped = await asyncio.wrap_future(empty._worker.submit(empty.executor.maybe_step))
            assert not stepped and empty.executor.step == 0
            holder.executor.close_batch(0, replicas=1)
            await _until(lambda: holder.executor.step == 1, "the holder steps alone on the batch")
            await _until(lambda: empty.executor.step == 1, "the empty replica takes its state")
            assert_same_tensors(params(await get_state(empty)), params(await get_state(holder)))
        finally:
            await empty.shutdown()
            await holder.shutdown()

    loop_thread.run(body())
