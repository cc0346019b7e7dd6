"""A global batch closes at each stage as soon as that stage has all of it: the last stage's all-reduce and step
then run while the stages before it still compute their part of the batch's last microbatch, off the path to the
next batch (real peers, real DHT, real gRPC; the trainer's pipeline and batch closer in this process)."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
from livepeers import RUN, B, T

from swarm.trainer.config import PipelineConfig
from swarm.trainer.pipeline import Pipeline
from swarm.trainer.trainer import _BatchCloser

pytestmark = pytest.mark.integration

# how long stage 0's backward waits for stage 1's close before it gives up (the old behaviour: it never comes)
WAIT_S = 15.0


def test_the_last_stage_closes_its_batch_while_the_first_still_computes_its_backward(
    peers, loop_thread
):
    first, last = peers("early-close", 0), peers("early-close", 1)
    closes: list[tuple[int, int]] = []  # (stage, batch step) of each CloseBatch a replica got
    last_closed = threading.Event()
    for peer in (first, last):
        honest_close = peer.executor.close_batch

        def close(batch_step, *args, _peer=peer, _honest=honest_close, **kwargs):
            closes.append((_peer.stage_index, batch_step))
            if _peer is last:
                last_closed.set()
            return _honest(batch_step, *args, **kwargs)

        peer.executor.close_batch = close
    honest_backward = first.executor.backward
    waited: list[bool] = []

    def backward(*args, **kwargs):
        # stage 0's backward of the batch's only microbatch: it returns once stage 1 has been told to close
        waited.append(last_closed.wait(WAIT_S))
        return honest_backward(*args, **kwargs)

    first.executor.backward = backward

    async def body():
        pipeline = Pipeline(last.directory, RUN, config=PipelineConfig(), seed=0)
        await pipeline.start()
        try:
            deadline = time.monotonic() + 30
            while not (pipeline.router.peers(0) and pipeline.router.peers(1)):
                assert time.monotonic() < deadline, "the peers were never listed"
                await pipeline._next_refresh(timeout_s=1.0)
            closer = _BatchCloser(pipeline, per_step=1, first_steps=[0, 0])
            result = await pipeline.train_microbatch(
                "mb-0",
                torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(0)),
                [0, 0],
                None,
                on_settled=functools.partial(closer.settled, 0),
            )
            closer.completed(0)
            await closer.close()
            return result
        finally:
            await pipeline.close()

    result = loop_thread.run(body())
    assert waited == [True], "stage 1 was closed only after stage 0's backward"
    assert result.samples == RUN.target_batch_size
    # each stage is closed once for the batch, the last stage first
    assert closes == [(1, 0), (0, 0)], closes
