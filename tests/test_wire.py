"""Chunk and batch frames built and read without protobuf (swarm/transport/wire.py): the same bytes as protobuf's,
chunks read back as views, batches bounded, and a peer that speaks plain protobuf still understood both ways over a
real gRPC server."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError

from swarm.compression import get_codec
from swarm.errors import InvalidRequest
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.proto import swarm_pb2_grpc as pb_grpc
from swarm.transport.server import start_server, stream_handler
from swarm.transport.tensors import FrameReader, tensor_frames
from swarm.transport.wire import (
    STAGE_METHODS,
    Batch,
    Chunk,
    pack,
    parse_frame,
    serialize_frame,
    stage_stub,
)

SIZES = [0, 1, 127, 128, 300, 16383, 16384, 1 << 20]


@pytest.mark.unit
@pytest.mark.parametrize("size", SIZES)
def test_a_chunk_frame_is_byte_identical_to_protobufs(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    chunk = Chunk.of(payload)
    assert chunk.wire == pb.Frame(chunk=payload).SerializeToString()
    assert serialize_frame(chunk) == chunk.wire and chunk.ByteSize() == len(chunk.wire)
    # from any buffer: a float tensor's memory encodes as its raw bytes
    floats = torch.arange(size // 4, dtype=torch.float32)
    raw = floats.numpy().tobytes()
    assert Chunk.of(memoryview(floats.numpy())).wire == pb.Frame(chunk=raw).SerializeToString()


@pytest.mark.unit
@pytest.mark.parametrize("size", SIZES)
def test_a_received_chunk_is_a_view_of_the_message(size: int) -> None:
    payload = bytes(reversed(range(256))) * (size // 256) + b"\x05" * (size % 256)
    parsed = parse_frame(pb.Frame(chunk=payload).SerializeToString())
    assert type(parsed) is Chunk and parsed.WhichOneof("kind") == "chunk"
    assert isinstance(parsed.chunk, memoryview) and parsed.chunk == payload


@pytest.mark.unit
def test_anything_but_exactly_one_chunk_field_is_left_to_protobuf() -> None:
    request = pb.Frame(request=pb.RequestMeta(run_id="r", microbatch_id="m"))
    assert parse_frame(request.SerializeToString()) == request
    assert serialize_frame(request) == request.SerializeToString()
    # a chunk field followed by another field: protobuf's oneof keeps the last one
    mixed = (
        pb.Frame(chunk=b"abc").SerializeToString()
        + pb.Frame(commit=pb.Commit()).SerializeToString()
    )
    assert parse_frame(mixed).WhichOneof("kind") == "commit"
    # a chunk whose length runs past the message, or a varint that never ends: protobuf's DecodeError
    for garbage in (b"\x22\x05ab", b"\x22" + b"\xff" * 11, b"\x22"):
        with pytest.raises(DecodeError):
            parse_frame(garbage)
    assert parse_frame(b"") == pb.Frame()


def _request(microbatch_id: str = "m") -> pb.Frame:
    return pb.Frame(request=pb.RequestMeta(run_id="r", microbatch_id=microbatch_id, num_tensors=1))


def _header(numel: int, name: str = "x") -> pb.Frame:
    return pb.Frame(
        tensor=pb.TensorHeader(
            name=name, dtype="uint8", shape=[numel], codec="none", segment_numel=numel
        )
    )


@pytest.mark.unit
@pytest.mark.parametrize("size", [0, 5, 200, 1 << 20])
def test_a_packed_batch_is_byte_identical_to_protobufs_and_reads_back(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + b"\x09" * (size % 256)
    lead = [_request(), _header(size)]
    packed = pack(lead, payload)
    as_protobuf = pb.Frame(batch=pb.Batch(frames=[*lead, pb.Frame(chunk=payload)]))
    assert serialize_frame(packed) == as_protobuf.SerializeToString()
    parsed = parse_frame(packed.wire)
    assert type(parsed) is Batch and parsed.WhichOneof("kind") == "batch"
    assert parsed.frames[:2] == lead and type(parsed.frames[2]) is Chunk
    assert parsed.frames[2].chunk == payload and parsed.frames[2].wire == Chunk.of(payload).wire
    # without a payload: the frames alone; one frame travels as itself
    assert serialize_frame(pack(lead)) == pb.Frame(batch=pb.Batch(frames=lead)).SerializeToString()
    assert pack(lead[:1]) is lead[0] and type(pack([], payload)) is Chunk


@pytest.mark.unit
def test_a_batch_of_too_many_frames_is_refused_before_it_is_built() -> None:
    with pytest.raises(ValueError, match="at most 8"):
        pack([_request()] * 8, b"x")
    big = pb.Frame(batch=pb.Batch(frames=[_request()] * 9)).SerializeToString()
    with pytest.raises(DecodeError, match="more than 8"):
        parse_frame(big)


@pytest.mark.unit
@pytest.mark.parametrize(
    "batch, message",
    [
        (pb.Batch(), "a batch of 0 frames"),
        (
            pb.Batch(frames=[pb.Frame(batch=pb.Batch(frames=[_request()]))]),
            "a batch inside a batch",
        ),
    ],
)
def test_the_reader_refuses_empty_and_nested_batches(batch: pb.Batch, message: str) -> None:
    for frame in (parse_frame(pb.Frame(batch=batch).SerializeToString()), pb.Frame(batch=batch)):
        with pytest.raises(InvalidRequest, match=message):
            asyncio.run(FrameReader(_aiter([frame])).request())


@pytest.mark.unit
def test_the_reader_takes_a_batchs_frames_in_order_then_the_next_messages() -> None:
    x = torch.arange(10, dtype=torch.uint8)
    request = _request()
    request.request.num_tensors = 2
    # the first tensor packed with the request, the second one frame per message
    frames = [pack([request, _header(4)], x[:4].numpy()), _header(6, "y"), Chunk.of(x[4:].numpy())]

    async def go():
        reader = FrameReader(_aiter(frames))
        assert (await reader.request()).microbatch_id == "m"
        tensors = await reader.tensors(2)
        await reader.end()
        return tensors

    tensors = asyncio.run(go())
    assert tensors["x"].tolist() == [0, 1, 2, 3] and tensors["y"].tolist() == [4, 5, 6, 7, 8, 9]


@pytest.mark.unit
def test_every_rpc_of_the_proto_is_registered() -> None:
    assert STAGE_METHODS == {
        "Forward",
        "Backward",
        "Info",
        "GetState",
        "Commit",
        "CloseBatch",
        "DialBack",
        "ReducePart",
    }


class Echo(pb_grpc.StagePeerServicer):
    """Streams back the tensors it receives, re-encoded in the call's codec, the reply packed with the first."""

    @stream_handler
    async def Forward(self, request_iterator, context):
        reader = FrameReader(request_iterator)
        meta = await reader.request()
        tensors = await reader.tensors(meta.num_tensors)
        await reader.end()
        lead = [pb.Frame(reply=pb.ReplyMeta(num_tensors=len(tensors)))]
        for name, t in tensors.items():
            codec = get_codec(meta.codec)
            async for f in tensor_frames(name, t, codec, segment_bytes=1 << 16, lead=lead):
                yield f
            lead = []


@pytest.mark.integration
@pytest.mark.parametrize("codec", ["none", "int8"])
@pytest.mark.parametrize("plain_client", [True, False])
def test_plain_protobuf_and_swarm_clients_both_talk_to_the_server(codec: str, plain_client: bool):
    """The generated stub (protobuf (de)serializers, one frame per message: what any other implementation of the
    proto would send and expect) and swarm's own stub (packed batches, chunk views) exchange the same tensors with
    a server that uses the fast path."""
    x = torch.randn(3, 50_000, generator=torch.Generator().manual_seed(1))  # 10 segments of 64 KiB

    async def go():
        server, port = await start_server(Echo(), host="127.0.0.1", port=0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.StagePeerStub(channel) if plain_client else stage_stub(channel)
                meta = pb.RequestMeta(
                    protocol_version=PROTOCOL_VERSION, codec=codec, microbatch_id="m", num_tensors=1
                )
                frames = [pb.Frame(request=meta)] if plain_client else []
                lead = None if plain_client else [pb.Frame(request=meta)]
                async for f in tensor_frames(
                    "x", x, get_codec(codec), segment_bytes=1 << 16, lead=lead
                ):
                    # a plain client builds protobuf messages itself
                    plain = plain_client and type(f) is Chunk
                    frames.append(pb.Frame(chunk=bytes(f.chunk)) if plain else f)

                async def send():
                    for f in frames:
                        yield f

                call = stub.Forward(send(), timeout=30)
                received = [f async for f in call]
        finally:
            await server.stop(None)
        # the reply, the header and the first chunk in one Batch message; the other 9 chunks one per message
        assert {type(f) for f in received} == ({pb.Frame} if plain_client else {Batch, Chunk})
        assert received[0].WhichOneof("kind") == "batch" and len(received) == 10
        reader = FrameReader(_aiter(received))
        got = await reader.reply()
        return await reader.tensors(got.num_tensors)

    tensors = asyncio.run(go())
    # the tensor crossed the codec twice: to the server and back
    expected = x.view(-1)
    for _ in range(2):
        expected = get_codec(codec).decode(get_codec(codec).encode(expected), x.numel(), x.dtype)
    assert torch.equal(tensors["x"], expected.view(x.shape))


async def _aiter(items):
    for item in items:
        yield item
