"""Chunked tensor streams: framing, reassembly, limits, and a 64 MiB tensor through a real gRPC server."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from swarm.compression import get_codec
from swarm.errors import InvalidRequest
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.proto import swarm_pb2_grpc as pb_grpc
from swarm.transport.client import PeerClient
from swarm.transport.server import start_server, stream_handler
from swarm.transport.tensors import FrameReader, StreamLimits, tensor_frames

MiB = 1 << 20


async def _frames(tensor, codec="none", segment_bytes=MiB):
    return [f async for f in tensor_frames("x", tensor, get_codec(codec), segment_bytes=segment_bytes)]


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
    assert len(chunks) == 64 and all(len(f.chunk) == MiB for f in chunks)  # 1 MiB each: under gRPC's cap
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
    header = pb.TensorHeader(name="x", dtype="float32", shape=[1 << 20, 1 << 20], codec="none", segment_numel=1024)
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
            meta = pb.RequestMeta(protocol_version=PROTOCOL_VERSION, codec="none", microbatch_id="m")
            return await client.forward(meta, [("big", big)], get_codec("none"), timeout_s=120)
        finally:
            await client.close()
            await server.stop(None)

    reply = asyncio.run(go())
    assert reply.meta.step == 1 and torch.equal(reply.tensors["big"], big)


def test_client_maps_unreachable_peer_to_transport_error():
    from swarm.errors import TransportError

    async def go():
        client = PeerClient("127.0.0.1:1")  # nothing listens on port 1
        try:
            await client.info(timeout_s=2)
        finally:
            await client.close()

    with pytest.raises(TransportError):
        asyncio.run(go())
