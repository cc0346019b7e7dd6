"""Chunked tensor streams: framing, reassembly, limits, a 64 MiB tensor and typed errors through a real gRPC
server."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from swarm.compression import CodecError, NonFiniteTensorError, get_codec
from swarm.data import CorpusError
from swarm.discovery.records import RecordError
from swarm.errors import (
    ERROR_METADATA_KEY,
    WIRE_ERRORS,
    InvalidRequest,
    PeerOverloaded,
    StageUnavailable,
    SwarmError,
    TransportError,
    UsageError,
    WrongPeer,
)
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.proto import swarm_pb2_grpc as pb_grpc
from swarm.routing import NoPeersAvailable, RetriesExhausted, RoutingError
from swarm.transport.channel import GRPC_OPTIONS
from swarm.transport.client import PeerClient
from swarm.transport.server import start_server, stream_handler, unary_handler
from swarm.transport.tensors import FrameReader, StreamLimits, tensor_frames

pytestmark = pytest.mark.integration

MiB = 1 << 20


async def _frames(tensor, codec="none", segment_bytes=MiB):
    return [
        f async for f in tensor_frames("x", tensor, get_codec(codec), segment_bytes=segment_bytes)
    ]


async def _aiter(frames):
    for f in frames:
        yield f


def _read(frames, limits=StreamLimits()):
    count = sum(f.WhichOneof("kind") == "tensor" for f in frames)

    async def go():
        return await FrameReader(_aiter(frames), limits=limits).tensors(count)

    return asyncio.run(go())


def test_64mib_tensor_is_chunked_and_reassembled_exactly():
    big = torch.randn(16384, 1024, generator=torch.Generator().manual_seed(0))  # float32: 64 MiB
    frames = asyncio.run(_frames(big))
    assert frames[0].WhichOneof("kind") == "tensor"
    chunks = frames[1:]
    # 1 MiB each: under gRPC's cap
    assert len(chunks) == 64 and all(len(f.chunk) == MiB for f in chunks)
    out = _read(frames)["x"]
    assert out.shape == big.shape and torch.equal(out, big)


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8"])
def test_segmented_codecs_round_trip(codec):
    x = torch.randn(3, 1000, 77, generator=torch.Generator().manual_seed(1))
    out = _read(asyncio.run(_frames(x, codec, segment_bytes=64 * 1024)))["x"]
    assert out.shape == x.shape and out.dtype == x.dtype
    rel = float((out - x).norm() / x.norm())
    assert rel < {"none": 1e-9, "fp16": 1e-3, "bf16": 1e-2, "int8": 2e-2}[codec]


def test_integer_tensors_pass_exactly_under_lossy_codec():
    tokens = torch.randint(0, 256, (8, 129))
    assert torch.equal(_read(asyncio.run(_frames(tokens, "int8")))["x"], tokens)


def test_truncated_stream_is_rejected():
    frames = asyncio.run(_frames(torch.randn(4 * MiB // 4)))
    with pytest.raises(InvalidRequest, match="stream ended early.*chunk 3"):
        _read(frames[:-1])


def test_limits_reject_before_allocation():
    header = pb.TensorHeader(
        name="x", dtype="float32", shape=[1 << 20, 1 << 20], codec="none", segment_numel=1024
    )
    with pytest.raises(InvalidRequest, match="more than the"):
        _read([pb.Frame(tensor=header)])
    header = pb.TensorHeader(name="x", dtype="float32", shape=[10], codec="int8", segment_numel=3)
    with pytest.raises(InvalidRequest, match="multiple of"):
        _read([pb.Frame(tensor=header)])


def test_unknown_dtype_and_duplicate_names():
    header = pb.TensorHeader(name="x", dtype="complex64", shape=[1], codec="none", segment_numel=1)
    with pytest.raises(InvalidRequest, match="complex64"):
        _read([pb.Frame(tensor=header)])
    frames = asyncio.run(_frames(torch.ones(3)))
    with pytest.raises(InvalidRequest, match="sent twice"):
        _read(frames + frames)


class Echo(pb_grpc.StagePeerServicer):
    """Streams back whatever tensors it receives: the transport alone, over a real gRPC server."""

    @stream_handler
    async def Forward(self, request_iterator, context):
        reader = FrameReader(request_iterator)
        meta = await reader.request()
        tensors = await reader.tensors(meta.num_tensors)
        await reader.end()
        yield pb.Frame(reply=pb.ReplyMeta(step=len(tensors), num_tensors=len(tensors)))
        for name, t in tensors.items():
            async for f in tensor_frames(name, t, get_codec(meta.codec)):
                yield f


def test_64mib_round_trip_over_grpc():
    big = torch.randn(16 * MiB, generator=torch.Generator().manual_seed(2))  # 64 MiB of float32

    async def go():
        server, port = await start_server(Echo(), host="127.0.0.1", port=0)
        client = PeerClient(f"127.0.0.1:{port}")
        try:
            meta = pb.RequestMeta(
                protocol_version=PROTOCOL_VERSION, codec="none", microbatch_id="m"
            )
            return await client.forward(meta, [("big", big)], get_codec("none"), timeout_s=120)
        finally:
            await client.close()
            await server.stop(None)

    reply = asyncio.run(go())
    assert reply.meta.step == 1 and torch.equal(reply.tensors["big"], big)


def test_client_maps_unreachable_peer_to_transport_error():
    async def go():
        client = PeerClient("127.0.0.1:1")  # nothing listens on port 1
        try:
            await client.info(timeout_s=2)
        finally:
            await client.close()

    with pytest.raises(TransportError):
        asyncio.run(go())


def test_a_server_accepts_the_keepalive_pings_its_clients_send():
    # A server that sees pings more often than it allows, while it sends nothing (a busy peer), closes the
    # connection with GOAWAY "too many pings" and every call on it fails at once (swarm/transport/channel.py).
    options = dict(GRPC_OPTIONS)
    assert (
        options["grpc.http2.min_ping_interval_without_data_ms"] <= options["grpc.keepalive_time_ms"]
    )


class Refuser(pb_grpc.StagePeerServicer):
    """Ends every call with the error it is given: how typed errors cross a real gRPC server."""

    def __init__(self):
        self.error: Exception | None = None
        self.raw: tuple[grpc.StatusCode, str, tuple] | None = (
            None  # a peer that names no class (or a bogus one)
        )

    @stream_handler
    async def Forward(self, request_iterator, context):
        await FrameReader(request_iterator).request()
        if self.raw is not None:
            code, details, metadata = self.raw
            await context.abort(code, details, trailing_metadata=metadata)
        raise self.error
        yield  # a generator, like every stream handler

    @unary_handler
    async def Info(self, request, context):
        raise self.error


async def _refused(servicer: Refuser, *, unary: bool = False) -> Exception:
    """Make one call to ``servicer`` over a real server on port 0 and return the error the client raised."""
    server, port = await start_server(servicer, host="127.0.0.1", port=0)
    client = PeerClient(f"127.0.0.1:{port}")
    try:
        if unary:
            await client.info(timeout_s=10)
        else:
            meta = pb.RequestMeta(
                protocol_version=PROTOCOL_VERSION, codec="none", microbatch_id="m"
            )
            await client.forward(meta, [], get_codec("none"), timeout_s=10)
    except SwarmError as e:
        return e
    finally:
        await client.close()
        await server.stop(None)
    raise AssertionError("the call succeeded")


@pytest.mark.parametrize("unary", [False, True], ids=["stream", "unary"])
@pytest.mark.parametrize("cls", WIRE_ERRORS, ids=lambda cls: cls.__name__)
def test_every_wire_error_comes_back_as_its_own_class(cls, unary):
    servicer = Refuser()
    servicer.error = cls("the peer's sentence")
    error = asyncio.run(_refused(servicer, unary=unary))
    assert type(error) is cls and "the peer's sentence" in str(error)
    assert error.retry_elsewhere == cls.retry_elsewhere


@pytest.mark.parametrize("cls", [WrongPeer, TransportError, StageUnavailable, SwarmError])
def test_the_word_draining_in_another_error_does_not_make_it_peer_draining(cls):
    servicer = Refuser()
    servicer.error = cls("peer p1 is draining its queue")
    assert type(asyncio.run(_refused(servicer))) is cls


def test_a_peer_that_names_no_class_is_understood_by_its_code_alone():
    servicer = Refuser()
    # An older peer: no name, and the text says draining. The text is not read; UNAVAILABLE means transport.
    servicer.raw = (grpc.StatusCode.UNAVAILABLE, "peer p1 is draining", ())
    assert type(asyncio.run(_refused(servicer))) is TransportError
    servicer.raw = (grpc.StatusCode.NOT_FOUND, "serves stage 1", ())
    assert type(asyncio.run(_refused(servicer))) is WrongPeer
    servicer.raw = (grpc.StatusCode.RESOURCE_EXHAUSTED, "full", ())
    assert type(asyncio.run(_refused(servicer))) is PeerOverloaded


@pytest.mark.parametrize("name", ["RetriesExhausted", "SystemExit", "CodecError", "object", ""])
def test_a_name_outside_the_wire_family_never_picks_the_class(name):
    servicer = Refuser()
    servicer.raw = (grpc.StatusCode.INVALID_ARGUMENT, "bad", ((ERROR_METADATA_KEY, name),))
    assert type(asyncio.run(_refused(servicer))) is InvalidRequest


def test_a_codec_error_in_a_handler_reaches_the_caller_as_invalid_request():
    servicer = Refuser()
    servicer.error = NonFiniteTensorError("tensor 'input' holds NaN")
    error = asyncio.run(_refused(servicer))
    assert type(error) is InvalidRequest and not error.retry_elsewhere and "holds NaN" in str(error)


def test_error_family_has_one_root():
    for cls in (
        *WIRE_ERRORS,
        UsageError,
        CodecError,
        NonFiniteTensorError,
        RoutingError,
        NoPeersAvailable,
        RetriesExhausted,
        RecordError,
        CorpusError,
    ):
        assert issubclass(cls, SwarmError), cls
    # Callers that catch the builtin kinds keep working.
    assert issubclass(CodecError, ValueError) and issubclass(RecordError, ValueError)
    assert issubclass(CorpusError, ValueError) and issubclass(RoutingError, RuntimeError)
