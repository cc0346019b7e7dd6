"""A real `swarm peer`, slowed down, sheds work its callers' deadlines rule out: real gRPC deadlines, real queue."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from swarm.compression import get_codec
from swarm.errors import DeadlineUnmet, TransportError
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.transport.client import PeerClient
from swarm.transport.security import address_by_handshake

pytestmark = pytest.mark.swarm

B, T = 8, 128  # one microbatch of the tiny preset's full sequence length
FLAGS = ["--preset", "tiny", "--no-average", "--no-rebalance", "--metrics-port", "0"]
CONCURRENT = 8


def shed_counts(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as page:
        text = page.read().decode()
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "swarm_peer_shed_calls_total"
    }


async def forwards(endpoint: str, *, first_id: int, count: int, timeout_s: float) -> list:
    """``count`` forwards of stage 0 at once; each result is a reply or the error it raised."""
    # the test's own peer: its TLS certificate is trusted on first use (swarm itself pins it from the record)
    client = PeerClient(await asyncio.to_thread(address_by_handshake, endpoint))

    async def one(i: int):
        meta = pb.RequestMeta(
            protocol_version=PROTOCOL_VERSION,
            run_id="shed",
            stage=0,
            codec="none",
            microbatch_id=f"mb{i}",
            num_samples=B,
        )
        x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(i))
        return await client.forward(meta, [("input", x)], get_codec("none"), timeout_s=timeout_s)

    try:
        return await asyncio.gather(
            *(one(first_id + i) for i in range(count)), return_exceptions=True
        )
    finally:
        await client.close()


def test_slow_peer_refuses_work_that_would_end_after_the_callers_deadline(local_swarm):
    # A device 20x slower: one forward takes a measurable time, so a queue of them outlasts a short deadline.
    proc = local_swarm.peer("slow", 0, *FLAGS, "--slowdown", "20", run_id="shed")
    endpoint = local_swarm.wait_ready(proc)
    url = proc.wait_for(r"serves Prometheus metrics at (http://\S+/metrics)", timeout_s=5).group(1)

    # Forwards one at a time, with time to spare: what a call costs end to end here (the fastest of three).
    times = []
    for i in range(3):
        started = time.monotonic()
        (alone,) = asyncio.run(forwards(endpoint, first_id=i, count=1, timeout_s=60))
        times.append(time.monotonic() - started)
        assert not isinstance(alone, BaseException), alone
    one_call_s = min(times)
    assert shed_counts(url) == {"expired": 0, "unmeetable": 0, "queue_full": 0}

    # Eight at once, each allowed 2.5 calls' time: the peer takes the first two or three and refuses the rest at
    # once, instead of computing replies their callers will not wait for. (Its prediction covers its compute, not
    # the transfers around it: on a loaded machine the last call it took may still miss its deadline.)
    results = asyncio.run(
        forwards(endpoint, first_id=100, count=CONCURRENT, timeout_s=2.5 * one_call_s)
    )
    refused = [r for r in results if isinstance(r, DeadlineUnmet)]
    answered = [r for r in results if not isinstance(r, BaseException)]
    late = [r for r in results if isinstance(r, TransportError) and "deadline" in str(r).lower()]
    assert len(refused) + len(answered) + len(late) == CONCURRENT, results
    assert answered and len(late) <= 1 and len(refused) >= CONCURRENT - 3, results
    assert "end after the caller's deadline" in str(refused[0])
    counts = shed_counts(url)
    assert counts["unmeetable"] + counts["expired"] == len(refused), counts
