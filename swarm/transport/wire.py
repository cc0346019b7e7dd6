"""How ``Frame`` messages cross gRPC: protobuf for the control frames, hand-built bytes for the tensor chunks.

A chunk frame is the protobuf encoding of ``Frame(chunk=payload)``: one tag byte, the payload length as a varint,
then the payload. Building those bytes directly (:class:`Chunk`) and reading the payload as a view of the bytes gRPC
delivered saves the copies protobuf makes on the way (into the message, out of it on serialization, into the parsed
message, and again on every read of ``frame.chunk``): per MiB chunk, four copies on a hop's each side. A
:class:`Batch` (``Frame.batch``) carries the small frames that open a call or a tensor in the same message as the
chunk after them: one gRPC message per chunk, as a bare byte stream would send. The bytes on the wire are exactly
protobuf's, so either end may be a plain protobuf implementation, and any message not in the layout written here is
parsed by protobuf as before (its errors included).

Use :func:`stage_stub` for a client and :func:`add_stage_servicer` for a server instead of the generated
``StagePeerStub`` and ``add_StagePeerServicer_to_server``: they differ only in these (de)serializers.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from swarm.proto import swarm_pb2 as pb
from swarm.proto import swarm_pb2_grpc as pb_grpc

_SERVICE = "swarm.v1.StagePeer"
# protobuf tags: (field number << 3) | 2 (length-delimited)
_CHUNK_TAG = 0x22  # Frame.chunk (4)
_BATCH_TAG = 0x32  # Frame.batch (6)
_FRAMES_TAG = 0x0A  # Batch.frames (1)
_MAX_VARINT_BYTES = 10
MAX_BATCH_FRAMES = 8  # frames in one Batch (proto/swarm.proto)
# The service's methods, as the proto declares them: add_stage_servicer registers each (checked at import).
STAGE_METHODS = frozenset(m.name for m in pb.DESCRIPTOR.services_by_name["StagePeer"].methods)


class Chunk:
    """A ``Frame`` holding only ``chunk``, kept as bytes: its own message, or a part of a :class:`Batch`'s. It
    answers the few questions the transport asks a frame (``WhichOneof("kind")``, ``chunk``, ``ByteSize()``), so
    readers handle it and ``pb.Frame`` alike."""

    __slots__ = ("_buffer", "_frame", "_start", "_end")

    def __init__(self, buffer: bytes, frame: int, start: int, end: int):
        self._buffer = buffer
        # where in ``buffer`` the frame starts, its payload starts, and both end
        self._frame, self._start, self._end = frame, start, end

    @classmethod
    def of(cls, payload) -> Chunk:
        """The chunk frame of ``payload`` (bytes, or any contiguous buffer: it is copied once, here)."""
        view = memoryview(payload)
        header = _chunk_header(view.nbytes)
        wire = header + view  # bytes + any contiguous buffer: one copy
        return cls(wire, 0, len(header), len(wire))

    @property
    def chunk(self) -> memoryview:
        """The payload: a read-only view of the received bytes (no copy)."""
        return memoryview(self._buffer)[self._start : self._end]

    @property
    def wire(self) -> bytes:
        """The frame's protobuf encoding."""
        if self._frame == 0 and self._end == len(self._buffer):
            return self._buffer
        return self._buffer[self._frame : self._end]

    def WhichOneof(self, group: str) -> str:  # noqa: N802 (protobuf's name)
        return "chunk"

    def ByteSize(self) -> int:  # noqa: N802 (protobuf's name)
        return self._end - self._frame


class Batch:
    """Several frames in one message (``Frame.batch``), with the message's bytes. :func:`pack` builds one;
    :func:`parse_frame` reads one without copying its chunk."""

    __slots__ = ("frames", "wire")

    def __init__(self, frames: list, wire: bytes):
        self.frames, self.wire = frames, wire

    def WhichOneof(self, group: str) -> str:  # noqa: N802 (protobuf's name)
        return "batch"

    def ByteSize(self) -> int:  # noqa: N802 (protobuf's name)
        return len(self.wire)


def pack(frames: list[pb.Frame], payload=None) -> Batch | Chunk | pb.Frame:
    """One message holding ``frames`` and then, if given, a chunk frame of ``payload`` (any contiguous buffer, copied
    once, here). A single frame travels as itself."""
    if not frames:
        if payload is None:
            raise ValueError("pack() needs frames or a payload")
        return Chunk.of(payload)
    if payload is None and len(frames) == 1:
        return frames[0]
    if len(frames) + (payload is not None) > MAX_BATCH_FRAMES:
        raise ValueError(f"a batch holds at most {MAX_BATCH_FRAMES} frames")
    parts = []
    for frame in frames:
        encoded = frame.SerializeToString()
        parts += [bytes((_FRAMES_TAG,)), _varint(len(encoded)), encoded]
    inner = sum(len(p) for p in parts)
    if payload is None:
        return Batch(frames, bytes((_BATCH_TAG,)) + _varint(inner) + b"".join(parts))
    view = memoryview(payload)
    chunk_header = _chunk_header(view.nbytes)
    chunk_frame = len(chunk_header) + view.nbytes
    parts += [bytes((_FRAMES_TAG,)), _varint(chunk_frame), chunk_header]
    inner += 1 + len(_varint(chunk_frame)) + chunk_frame
    prefix = bytes((_BATCH_TAG,)) + _varint(inner) + b"".join(parts)
    wire = prefix + view  # the one copy of the payload
    start = len(prefix)
    chunk = Chunk(wire, start - len(chunk_header), start, start + view.nbytes)
    return Batch([*frames, chunk], wire)


def serialize_frame(frame: pb.Frame | Chunk | Batch) -> bytes:
    """A frame's wire bytes: a :class:`Chunk` or :class:`Batch` already is them; protobuf encodes the rest."""
    kind = type(frame)
    return frame.wire if kind is Chunk or kind is Batch else frame.SerializeToString()


def parse_frame(data: bytes) -> pb.Frame | Chunk | Batch:
    """A received message as a frame: exactly one chunk field becomes a :class:`Chunk` viewing ``data``, a batch in
    the layout :func:`pack` writes a :class:`Batch` of such frames; anything else is parsed by protobuf (which
    raises ``DecodeError`` for garbage)."""
    if data:
        if data[0] == _CHUNK_TAG:
            chunk = _parse_chunk(data, 0, len(data))
            if chunk is not None:
                return chunk
        elif data[0] == _BATCH_TAG:
            batch = _parse_batch(data)
            if batch is not None:
                return batch
    return pb.Frame.FromString(data)


def _parse_chunk(data: bytes, frame: int, end: int) -> Chunk | None:
    """The frame ``data[frame:end]`` as a Chunk, if it is exactly one chunk field."""
    length, start = _read_varint(data, frame + 1)
    if length >= 0 and start + length == end:
        return Chunk(data, frame, start, end)
    return None


def _parse_batch(data: bytes) -> Batch | None:
    """``data`` as a Batch, if it is one batch field of frames in :func:`pack`'s layout (else None: protobuf reads
    it). Raises DecodeError for a batch of too many frames, before building them."""
    length, pos = _read_varint(data, 1)
    if length < 0 or pos + length != len(data):
        return None
    spans = []
    while pos < len(data):
        if data[pos] != _FRAMES_TAG:
            return None
        length, start = _read_varint(data, pos + 1)
        if length < 0 or start + length > len(data):
            return None
        spans.append((start, start + length))
        if len(spans) > MAX_BATCH_FRAMES:
            raise DecodeError(f"a batch of more than {MAX_BATCH_FRAMES} frames")
        pos = start + length
    frames = []
    for start, end in spans:
        chunk = (
            _parse_chunk(data, start, end) if end > start and data[start] == _CHUNK_TAG else None
        )
        frames.append(chunk if chunk is not None else pb.Frame.FromString(data[start:end]))
    return Batch(frames, data)


def _chunk_header(length: int) -> bytes:
    return bytes((_CHUNK_TAG,)) + _varint(length)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it); (-1, pos) when ``data`` holds no complete varint there."""
    value = shift = 0
    for i in range(pos, min(len(data), pos + _MAX_VARINT_BYTES)):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    return -1, pos


def stage_stub(channel: grpc.aio.Channel) -> pb_grpc.StagePeerStub:
    """The generated client stub with the frame streams (de)serialized by :func:`serialize_frame` and
    :func:`parse_frame`."""
    stub = pb_grpc.StagePeerStub(channel)
    stub.Forward = channel.stream_stream(
        f"/{_SERVICE}/Forward",
        request_serializer=serialize_frame,
        response_deserializer=parse_frame,
    )
    stub.Backward = channel.stream_stream(
        f"/{_SERVICE}/Backward",
        request_serializer=serialize_frame,
        response_deserializer=parse_frame,
    )
    stub.ReducePart = channel.stream_stream(
        f"/{_SERVICE}/ReducePart",
        request_serializer=serialize_frame,
        response_deserializer=parse_frame,
    )
    stub.GetState = channel.unary_stream(
        f"/{_SERVICE}/GetState",
        request_serializer=pb.StateRequest.SerializeToString,
        response_deserializer=parse_frame,
    )
    return stub


def add_stage_servicer(servicer: pb_grpc.StagePeerServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` like ``add_StagePeerServicer_to_server``, with the frame streams (de)serialized by
    :func:`parse_frame` and :func:`serialize_frame`."""
    frames = dict(request_deserializer=parse_frame, response_serializer=serialize_frame)
    handlers = {
        "Forward": grpc.stream_stream_rpc_method_handler(servicer.Forward, **frames),
        "Backward": grpc.stream_stream_rpc_method_handler(servicer.Backward, **frames),
        "ReducePart": grpc.stream_stream_rpc_method_handler(servicer.ReducePart, **frames),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info,
            request_deserializer=pb.InfoRequest.FromString,
            response_serializer=pb.InfoResponse.SerializeToString,
        ),
        "GetState": grpc.unary_stream_rpc_method_handler(
            servicer.GetState,
            request_deserializer=pb.StateRequest.FromString,
            response_serializer=serialize_frame,
        ),
        "Commit": grpc.unary_unary_rpc_method_handler(
            servicer.Commit,
            request_deserializer=pb.CommitRequest.FromString,
            response_serializer=pb.CommitReply.SerializeToString,
        ),
        "CloseBatch": grpc.unary_unary_rpc_method_handler(
            servicer.CloseBatch,
            request_deserializer=pb.CloseBatchRequest.FromString,
            response_serializer=pb.CloseBatchReply.SerializeToString,
        ),
        "DialBack": grpc.unary_unary_rpc_method_handler(
            servicer.DialBack,
            request_deserializer=pb.DialBackRequest.FromString,
            response_serializer=pb.DialBackReply.SerializeToString,
        ),
    }
    if set(handlers) != STAGE_METHODS:  # the proto gained or lost an RPC: register it here too
        raise RuntimeError(
            f"swarm.transport.wire registers {sorted(handlers)}, the proto declares {sorted(STAGE_METHODS)}"
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)
