"""A real peer (real DHT, real gRPC on port 0) attacked with crafted requests stays within its bounds: headers
checked against the model before any allocation, a request-memory budget, read deadlines, streams per caller,
a bounded compute queue, idle streams not counted as load, and one log line for a flood of garbage frames."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import pytest
import torch

from swarm.compression import get_codec
from swarm.config import RunConfig
from swarm.model import ModelConfig
from swarm.peer.config import LimitsConfig, PeerConfig
from swarm.peer.lifecycle import Peer
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.transport import server
from swarm.transport.callers import default_token
from swarm.transport.client import PeerClient
from swarm.transport.security import PeerAddress, open_channel
from swarm.transport.tensors import tensor_frames
from swarm.transport.wire import stage_stub

pytestmark = pytest.mark.integration

MODEL = ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16, num_stages=2)
RUN = RunConfig(model=MODEL, target_batch_size=10_000)  # never steps
B, T, D = 2, 16, 32
NONE = get_codec("none")
# Short read deadlines for the deadline tests; the other peer's are long, so its idle streams stay open.
QUICK = LimitsConfig(read_idle_s=1.0, read_total_s=2.0)
ROOMY = LimitsConfig(
    read_idle_s=120.0,
    read_total_s=240.0,
    max_streams_per_caller=3,
    max_queued_calls=1,
    # every open call reserves its receive window (64 KiB here, the least there is): the budget holds three idle
    # calls, or one with a (64, T, D) float input (128 KiB) but not its targets too
    stream_window_bytes=64 << 10,
    request_memory_bytes=(64 + 132) << 10,
)


@pytest.fixture(scope="module")
def peers(loop_thread):
    async def start():
        quick = await Peer.create(
            PeerConfig(run_id="bq", stage=1, limits=QUICK, log_every_s=0), run=RUN
        )
        roomy = await Peer.create(
            PeerConfig(run_id="br", stage=1, limits=ROOMY, log_every_s=0, max_microbatch_size=64),
            run=RUN,
        )
        return quick, roomy

    quick, roomy = loop_thread.run(start())
    yield quick, roomy
    loop_thread.run(quick.shutdown())
    loop_thread.run(roomy.shutdown())


def meta(peer: Peer, **kw) -> pb.RequestMeta:
    kw.setdefault("microbatch_id", "mb")
    return pb.RequestMeta(
        protocol_version=PROTOCOL_VERSION,
        run_id=peer.run_id,
        stage=1,
        codec="none",
        compute_loss=True,
        **kw,
    )


def header(shape, dtype="float32", name="input") -> pb.Frame:
    numel = 1
    for s in shape:
        numel *= s
    return pb.Frame(
        tensor=pb.TensorHeader(
            name=name,
            dtype=dtype,
            shape=list(shape),
            codec="none",
            segment_numel=max(1, min(numel, 1 << 20)),
        )
    )


def auth(address: PeerAddress):
    """The metadata that authenticates this test process's calls to ``address``."""
    return default_token().metadata(address.peer_id)


async def call(
    address: PeerAddress, frames, *, then_wait: asyncio.Event | None = None, method="Forward"
):
    """Send ``frames`` (then, with ``then_wait``, keep the stream open and silent until it is set); return the
    call's (status code, details)."""
    async with open_channel(address) as channel:
        stub = stage_stub(channel)

        async def gen():
            for f in frames:
                yield f
            if then_wait is not None:
                await then_wait.wait()

        try:
            async for _ in getattr(stub, method)(gen(), timeout=60, metadata=auth(address)):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


async def loss_call(peer: Peer, mb: str):
    client = PeerClient(peer.address)
    try:
        x = torch.randn(B, T, D)
        targets = torch.randint(0, 256, (B, T))
        reply = await client.forward(
            meta(peer, microbatch_id=mb, num_samples=B),
            [("input", x), ("targets", targets)],
            NONE,
            timeout_s=60,
        )
        await reply.committed
        return reply
    finally:
        await client.close()


async def until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Wait (on the peers' own loop) until ``condition()`` holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    "shape, code, needle",
    [
        # more samples than --max-microbatch-size (each shape below is refused before it is allocated)
        ((1000, T, D), grpc.StatusCode.INVALID_ARGUMENT, "more than the 64 this peer accepts"),
        ((B, 1 << 20, D), grpc.StatusCode.INVALID_ARGUMENT, "1..16 tokens (the model's seq_len)"),
        ((B, T, 1 << 20), grpc.StatusCode.INVALID_ARGUMENT, "of width 32"),
        ((0, T, D), grpc.StatusCode.INVALID_ARGUMENT, "does not fit stage 1"),
        # fits the model; its input fits the peer's 132 KiB of request memory, its targets (8 KiB) then do not
        ((64, T, D), None, None),
    ],
)
def test_a_header_is_refused_before_its_payload_is_sent_or_allocated(
    peers, loop_thread, shape, code, needle
):
    """Only the header travels, and the stream then stays open: the answer can only come from the header."""
    _, roomy = peers

    async def body():
        hold = asyncio.Event()
        frames = [pb.Frame(request=meta(roomy, num_tensors=2)), header(shape)]
        if code is None:
            frames = [
                pb.Frame(request=meta(roomy, num_tensors=2)),
                header(shape),
                *[pb.Frame(chunk=b"\0" * (64 * T * D * 4))],
                header((64, T), dtype="int64", name="targets"),
            ]
        try:
            return await call(roomy.address, frames, then_wait=hold)
        finally:
            hold.set()

    got, details = loop_thread.run(body())
    if code is None:
        assert got == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "--request-memory-bytes=200704" in details, details
    else:
        assert got == code, details
        assert needle in details, details
    assert roomy.admission.open_calls == 0


def test_an_idle_stream_and_a_trickling_one_are_cut_with_a_clear_status(peers, loop_thread):
    quick, _ = peers
    x = torch.randn(B, T, D)

    async def trickle():
        """A whole, valid request sent one small chunk at a time, each well within the idle deadline."""
        frames = [pb.Frame(request=meta(quick, num_tensors=2))]
        frames += [f async for f in tensor_frames("input", x, NONE, segment_bytes=64)]
        async with open_channel(quick.address) as channel:

            async def gen():
                for f in frames:
                    yield f
                    await asyncio.sleep(
                        QUICK.read_idle_s / 4
                    )  # the attack: slow, never silent for long

            try:
                async for _ in stage_stub(channel).Forward(
                    gen(), timeout=60, metadata=auth(quick.address)
                ):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()

    async def body():
        hold = asyncio.Event()
        try:
            idle = await call(
                quick.address, [pb.Frame(request=meta(quick, num_tensors=2))], then_wait=hold
            )
            silent = await call(quick.address, [], then_wait=hold)  # not even a request frame
        finally:
            hold.set()
        return idle, silent, await trickle(), await loss_call(quick, "after")

    idle, silent, trickled, ok = loop_thread.run(body())
    for code, details in (idle, silent):
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
        assert "--read-idle-s=1s" in details, details
    assert trickled[0] == grpc.StatusCode.DEADLINE_EXCEEDED, trickled
    assert "--read-total-s=2s" in trickled[1], trickled
    assert ok.meta.has_loss  # the peer still serves
    assert quick.admission.open_calls == 0


def test_streams_per_caller_are_limited_and_idle_ones_are_not_announced_as_load(peers, loop_thread):
    _, roomy = peers

    async def body():
        hold = asyncio.Event()
        idle = [
            asyncio.ensure_future(
                call(roomy.address, [pb.Frame(request=meta(roomy, num_tensors=2))], then_wait=hold)
            )
            for _ in range(ROOMY.max_streams_per_caller)
        ]
        try:
            await until(lambda: roomy.admission.open_calls == 3, "the three idle streams are open")
            info = await PeerClient(roomy.address).info(roomy.run_id, timeout_s=10)
            one_more = await call(roomy.address, [pb.Frame(request=meta(roomy, num_tensors=2))])
        finally:
            hold.set()
        cut = await asyncio.gather(*idle)
        return (
            info,
            roomy._serving().in_flight,
            one_more,
            cut,
            await loss_call(roomy, "after-streams"),
        )

    info, announced, (code, details), cut, ok = loop_thread.run(body())
    assert info.in_flight == 0 and announced == 0  # three open streams, no work: no load
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "already has 3 calls open" in details and "--max-streams-per-caller=3" in details, (
        details
    )
    # the held streams ended when their callers closed them (nothing sent: a truncated request)
    assert {c for c, _ in cut} == {grpc.StatusCode.INVALID_ARGUMENT}
    assert ok.meta.has_loss


def test_a_full_compute_queue_answers_resource_exhausted(peers, loop_thread):
    """--max-queued-calls=1: with the compute thread held, one call queues and the next is refused."""
    _, roomy = peers
    blocker = threading.Event()

    async def body():
        held = asyncio.wrap_future(roomy._worker.submit(blocker.wait))  # holds the compute thread
        first = asyncio.ensure_future(loss_call(roomy, "queued"))
        try:
            await until(lambda: roomy.admission.in_flight == 1, "the first call waits for compute")
            refused = await call(
                roomy.address,
                [
                    pb.Frame(request=meta(roomy, microbatch_id="refused", num_tensors=2)),
                    *[f async for f in tensor_frames("input", torch.randn(B, T, D), NONE)],
                    *[
                        f
                        async for f in tensor_frames("targets", torch.randint(0, 256, (B, T)), NONE)
                    ],
                ],
            )
        finally:
            blocker.set()
        await held
        return refused, await first

    (code, details), first = loop_thread.run(body())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "--max-queued-calls=1" in details, details
    assert first.meta.has_loss  # the queued call was served once the thread was free


def test_garbage_frames_log_one_line_without_a_traceback(peers, loop_thread, caplog, monkeypatch):
    quick, _ = peers
    monkeypatch.setattr(server, "_garbage_log", server._RateLimitedLog(server.GARBAGE_LOG_EVERY_S))

    async def body():
        async with open_channel(quick.address) as channel:
            forward = channel.stream_stream(
                "/swarm.v1.StagePeer/Forward",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )

            async def garbage():
                yield b"\xff\xff\xff\xff not a frame"

            out = []
            for _ in range(20):
                try:
                    async for _ in forward(garbage(), timeout=30, metadata=auth(quick.address)):
                        pass
                except grpc.aio.AioRpcError as e:
                    out.append((e.code(), e.details()))
            return out

    with caplog.at_level(logging.WARNING):
        answers = loop_thread.run(body())
    assert {code for code, _ in answers} == {grpc.StatusCode.INVALID_ARGUMENT}
    assert all("could not be parsed" in details for _, details in answers)
    lines = [r for r in caplog.records if "could not be parsed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
