"""Chunked tensor streams: a tensor travels as one header frame and then one chunk frame per segment.

Each segment of the tensor's flat data is encoded on its own (segment sizes are multiples of the codec's
alignment, so the result equals encoding the whole tensor), straight into its chunk frame's wire bytes
(:class:`swarm.transport.wire.Chunk`), and decoded from a view of the bytes gRPC delivered. Senders pack the
frames that open a call or reply, and a tensor's header, with the first chunk after them into one message
(:class:`swarm.transport.wire.Batch`); :class:`FrameReader` reads a batch's frames as if each had come alone.

For a tensor of several segments, the sender encodes segment i+1 in a worker thread while segment i is on the
wire, and the receiver decodes segment i while segment i+1 arrives, so encode, transfer and decode overlap. A
tensor of one segment has nothing to overlap with: its codec work runs on the event loop, which is cheaper than
two thread hops (bench/results/hop_overhead.md).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import torch
from google.protobuf.message import DecodeError

from swarm.compression import Codec, CodecError, dtype_from_name, get_codec, wire_dtype_name
from swarm.errors import InvalidRequest
from swarm.proto import swarm_pb2 as pb
from swarm.transport.wire import MAX_BATCH_FRAMES, Batch, Chunk, pack

# Segments below this many raw bytes are encoded/decoded inline: a thread hop costs more than the work.
_INLINE_BYTES = 256 * 1024


@dataclass(frozen=True, kw_only=True)
class StreamLimits:
    """What a receiver accepts, so a hostile or buggy sender cannot make it allocate without bound."""

    max_numel: int = 1 << 28  # elements in one tensor (1 GiB of fp32)
    # elements in one chunk (the gRPC message cap bounds it anyway)
    max_segment_numel: int = 1 << 24

    def __post_init__(self):
        if self.max_numel < 1 or self.max_segment_numel < 1:
            raise ValueError(
                f"limits must be positive, got max_numel={self.max_numel}, "
                f"max_segment_numel={self.max_segment_numel}"
            )


def segment_numel_for(codec: Codec, dtype: torch.dtype, segment_bytes: int) -> int:
    """Elements per chunk: about ``segment_bytes`` of raw data, rounded down to the codec's alignment."""
    element_size = dtype.itemsize  # no tensor: a torch op on the event loop is a GIL handoff
    align = codec.alignment(dtype)
    return max(align, (segment_bytes // element_size) // align * align)


# Chunks of one tensor waiting for a decoder thread at once (see FrameReader._read_tensor).
MAX_PENDING_DECODES = 4


def _offloads(segment_bytes: int, total_bytes: int) -> bool:
    """Whether a tensor's codec work goes to worker threads: only when it has several segments (so the work
    overlaps the transfer) and they are large enough to pay for the thread hops."""
    return total_bytes > segment_bytes >= _INLINE_BYTES


def _offload(fn: Callable, *args) -> asyncio.Future:
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _encode_chunk(
    codec: Codec, segment: torch.Tensor, lead: list[pb.Frame], known_finite: bool
) -> Chunk | Batch:
    return pack(lead, codec.encode_view(segment, known_finite=known_finite))


async def tensor_frames(
    name: str,
    tensor: torch.Tensor,
    codec: Codec,
    *,
    segment_bytes: int = 1 << 20,
    lead: Sequence[pb.Frame] | None = None,
    known_finite: bool = False,
) -> AsyncIterator[pb.Frame | Chunk | Batch]:
    """Yield the header and chunk frames of ``tensor``; the next segment encodes while one is sent. With ``lead``
    (frames to send first, possibly none), they, the header and the first chunk travel as one :class:`Batch`
    message; without, the header travels alone. ``known_finite``: the caller has checked ``tensor`` for NaN/Inf
    (see ``Codec.encode_view``)."""
    flat = flat_cpu(tensor)
    seg = segment_numel_for(codec, flat.dtype, segment_bytes)
    header = pb.Frame(
        tensor=pb.TensorHeader(
            name=name,
            dtype=wire_dtype_name(flat.dtype),
            shape=list(tensor.shape),
            codec=codec.name,
            segment_numel=seg,
        )
    )
    first = [header] if lead is None else [*lead, header]
    if lead is None or flat.numel() == 0:
        yield pack(first)
        first = []
    numel = flat.numel()
    starts = range(0, numel, seg)
    offload = _offloads(seg * flat.element_size(), numel * flat.element_size())
    if not offload:
        if 0 < numel <= seg:  # one segment: the tensor itself, without a slicing op
            yield _encode_chunk(codec, flat, first, known_finite)
            return
        for start in starts:
            yield _encode_chunk(codec, flat[start : start + seg], first, known_finite)
            first = []
        return
    pending = None
    for start in starts:
        task = _offload(_encode_chunk, codec, flat[start : start + seg], first, known_finite)
        first = []
        if pending is not None:
            yield await pending
        pending = task
    if pending is not None:
        yield await pending


def flat_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a 1-D contiguous CPU tensor without autograd history (a view where it can be), calling only
    the torch ops it needs: on an event loop each one releases and retakes the GIL, which costs far more than the
    op when other threads hold it (bench/results/hop_overhead.md). Attribute reads do not release it."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor if tensor.dim() == 1 else tensor.view(-1)


class MalformedFrame(InvalidRequest):
    """A frame that does not parse as a swarm ``Frame``: garbage, or another protocol on the port."""


class FrameReader:
    """Reads a call's frames in protocol order and rebuilds tensors, validating everything it reads.

    Every malformed input raises :class:`InvalidRequest` with a sentence naming what was wrong.
    """

    def __init__(self, frames: AsyncIterator[pb.Frame], *, limits: StreamLimits = StreamLimits()):
        self._frames = frames.__aiter__()
        self._limits = limits
        self._queued: deque = deque()  # the rest of a batch

    async def _next(self) -> pb.Frame | Chunk | None:
        if self._queued:
            return self._queued.popleft()
        try:
            frame = await self._frames.__anext__()
        except StopAsyncIteration:
            return None
        except DecodeError as e:  # gRPC parses each message as it is read
            raise MalformedFrame(
                f"a frame could not be parsed ({e}); the sender speaks another protocol or sent garbage"
            ) from None
        if frame.WhichOneof("kind") != "batch":
            return frame
        frames = frame.frames if type(frame) is Batch else list(frame.batch.frames)
        if not 1 <= len(frames) <= MAX_BATCH_FRAMES:
            raise InvalidRequest(
                f"a batch of {len(frames)} frames; a batch holds 1 to {MAX_BATCH_FRAMES}"
            )
        if any(f.WhichOneof("kind") == "batch" for f in frames):
            raise InvalidRequest("a batch inside a batch; batches hold plain frames")
        self._queued.extend(frames[1:])
        return frames[0]

    async def _expect(self, kind: str, context: str) -> pb.Frame:
        frame = await self._next()
        if frame is None:
            raise InvalidRequest(
                f"stream ended early: expected a '{kind}' frame {context}; "
                f"the sender was cut off or speaks another protocol version"
            )
        got = frame.WhichOneof("kind")
        if got != kind:
            raise InvalidRequest(f"expected a '{kind}' frame {context}, got '{got}'")
        return frame

    async def request(self) -> pb.RequestMeta:
        return (await self._expect("request", "to open the call")).request

    async def reduce(self) -> pb.ReduceMeta:
        return (await self._expect("reduce", "to open the call")).reduce

    async def reply(self) -> pb.ReplyMeta:
        return (await self._expect("reply", "to open the reply")).reply

    async def tensors(
        self,
        count: int,
        check: Callable[[str, tuple[int, ...], torch.dtype, str], None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read exactly ``count`` tensors. ``check(name, shape, dtype, codec)`` may raise InvalidRequest
        to reject a tensor from its header, before any of its payload is received."""
        out: dict[str, torch.Tensor] = {}
        for index in range(count):
            header = (
                await self._expect("tensor", f"(header of tensor {index + 1} of {count})")
            ).tensor
            if header.name in out:
                raise InvalidRequest(f"tensor '{header.name}' was sent twice in one call")
            out[header.name] = await self._read_tensor(header, check)
        return out

    async def commit(self) -> pb.Commit:
        return (
            await self._expect("commit", "(the caller's commit after reading the reply)")
        ).commit

    async def end(self) -> None:
        frame = await self._next()
        if frame is not None:
            raise InvalidRequest(
                f"unexpected '{frame.WhichOneof('kind')}' frame after the last tensor"
            )

    async def _read_tensor(self, header: pb.TensorHeader, check) -> torch.Tensor:
        try:
            codec = get_codec(header.codec)
            dtype = dtype_from_name(header.dtype)
        except CodecError as e:
            raise InvalidRequest(f"tensor '{header.name}': {e}") from None
        shape = tuple(int(s) for s in header.shape)
        numel = math.prod(shape)
        if numel > self._limits.max_numel:
            raise InvalidRequest(
                f"tensor '{header.name}' of shape {list(shape)} has {numel} elements, "
                f"more than the {self._limits.max_numel} this receiver accepts"
            )
        seg = int(header.segment_numel)
        align = codec.alignment(dtype)
        if seg < 1 or seg > self._limits.max_segment_numel or (seg % align):
            raise InvalidRequest(
                f"tensor '{header.name}': segment_numel={seg} must be in [1, "
                f"{self._limits.max_segment_numel}] and a multiple of {align} "
                f"for codec '{codec.name}' and dtype {header.dtype}"
            )
        if check is not None:
            check(header.name, shape, dtype, codec.name)
        flat = torch.empty(numel, dtype=dtype)
        offload = _offloads(seg * flat.element_size(), numel * flat.element_size())
        decodes: deque[asyncio.Future] = deque()
        try:
            for index, start in enumerate(range(0, numel, seg)):
                payload = (
                    await self._expect("chunk", f"(chunk {index} of tensor '{header.name}')")
                ).chunk
                count = min(seg, numel - start)
                if not offload:
                    _decode_into(codec, payload, flat, start, count)
                    continue
                if len(decodes) >= MAX_PENDING_DECODES:
                    # each pending decode holds its chunk: a sender faster than the decoders must not make this
                    # call hold a second copy of its tensor beyond the memory reserved for it
                    await decodes.popleft()
                decodes.append(_offload(_decode_into, codec, payload, flat, start, count))
            await asyncio.gather(*decodes)
        except CodecError as e:
            raise InvalidRequest(f"tensor '{header.name}': {e}") from None
        finally:
            for task in decodes:
                task.cancel()
        return flat.view(shape)


def _decode_into(
    codec: Codec, payload: bytes | memoryview, out: torch.Tensor, start: int, count: int
) -> None:
    # a tensor of one segment decodes into itself, without a slicing op
    codec.decode_into(payload, out if count == out.numel() else out[start : start + count])


def codec_or_invalid(name: str) -> Codec:
    """The codec called ``name``, or InvalidRequest saying which codecs exist."""
    try:
        return get_codec(name)
    except CodecError as e:
        raise InvalidRequest(str(e)) from None
