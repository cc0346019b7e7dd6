"""The ``Codec`` contract shared by every wire codec, and the raw-bytes helpers they build on.

Contract (all codecs):

* ``encode`` takes a 1-D contiguous CPU tensor of a wire dtype (see ``swarm.compression.dtypes``) and returns
  exactly ``encoded_size(numel, dtype)`` bytes. ``decode`` inverts it and returns a fresh 1-D tensor of the original
  dtype that owns its memory (never a view into the payload buffer, which the transport may reuse).
* Non-floating dtypes (token ids, masks) always travel losslessly as raw little-endian bytes.
* Segments: a flat tensor may be cut at any multiple of ``segment_alignment`` elements and each piece encoded on its
  own; the concatenated payloads are byte-identical to encoding the whole tensor, and so are the decoded values.
* NaN/Inf policy: ``encode`` raises ``NonFiniteTensorError`` if the tensor holds NaN or ±Inf, and
  ``CodecOverflowError`` if a finite value does not fit the wire format. ``decode`` raises ``NonFiniteTensorError``
  if the payload decodes to any NaN/±Inf (a corrupt payload or a buggy sender): a peer never ships nor accepts
  non-finite values, so a divergence is caught at the first wire boundary instead of poisoning every replica.
* Bad payloads (wrong length, impossible values) raise ``CodecError`` with a sentence saying what to check.
"""

from __future__ import annotations

import abc
import math
import sys
from typing import ClassVar

import numpy as np
import torch

from swarm.compression.dtypes import wire_dtype_name
from swarm.compression.errors import CodecError, NonFiniteTensorError

if sys.byteorder != "little":  # raw tensor bytes are the host's; the wire format is little-endian
    raise ImportError(
        "swarm.compression supports little-endian hosts only; this host is big-endian"
    )

Payload = bytes | bytearray | memoryview


class Codec(abc.ABC):
    """Stateless, thread-safe encoder/decoder for one flat tensor segment (see the module docstring)."""

    name: ClassVar[str]  # the name that requests carry on the wire
    # elements; every segment but the last must be a multiple of this
    segment_alignment: ClassVar[int]

    def encode(self, flat: torch.Tensor) -> bytes:
        """Encode a 1-D contiguous CPU tensor; returns ``encoded_size(flat.numel(), flat.dtype)`` bytes.

        Raises ``ValueError`` for a tensor that breaks the shape/device/layout contract, ``CodecError`` for a
        dtype that cannot cross the wire, ``NonFiniteTensorError`` for NaN/Inf values and ``CodecOverflowError``
        for finite values outside the wire format's range.
        """
        encoded = self.encode_view(flat)
        return encoded if isinstance(encoded, bytes) else encoded.tobytes()

    def encode_view(self, flat: torch.Tensor, *, known_finite: bool = False) -> bytes | memoryview:
        """``encode``'s bytes, or a memoryview of them that may share memory with ``flat`` (codec ``none``): read it
        before ``flat`` changes. Saves ``encode``'s final copy for a caller that copies the bytes anyway (the
        transport builds its frame from them). Raises like ``encode``. ``known_finite``: the caller has just
        checked that ``flat`` holds no NaN/Inf, so a codec whose only check is that one (``none``) skips it; the
        others check as part of their encoding and do regardless."""
        _check_flat(flat)
        if flat.requires_grad:  # only then: each torch op on an event loop is a GIL handoff
            flat = flat.detach()
        if not flat.dtype.is_floating_point:
            return raw_view(flat)
        if known_finite:
            return self._encode_finite(flat)
        return self._encode_float(flat)

    def decode(self, payload: Payload, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Decode ``payload`` into a new 1-D tensor of ``numel`` elements of ``dtype`` that owns its memory.

        Raises ``CodecError`` if the payload length differs from ``encoded_size(numel, dtype)`` or its contents
        are impossible, and ``NonFiniteTensorError`` if it decodes to NaN/Inf.
        """
        self.encoded_size(numel, dtype)  # validates numel and dtype before allocating
        out = torch.empty(numel, dtype=dtype)
        self.decode_into(payload, out)
        return out

    def decode_into(self, payload: Payload, out: torch.Tensor) -> None:
        """Decode ``payload`` into ``out``, a 1-D contiguous CPU tensor (e.g. a slice of the whole tensor being
        received) whose dtype and numel are those that were encoded. Saves ``decode``'s extra copy.

        Raises like ``decode``; after an error ``out`` holds unspecified values. Never keeps a reference to
        ``payload``.
        """
        if (
            not isinstance(out, torch.Tensor)
            or out.dim() != 1
            or out.device.type != "cpu"
            or not out.is_contiguous()
        ):
            raise ValueError(
                "decode_into writes into a 1-D contiguous CPU tensor: pass a slice of a flat buffer"
            )
        numel, dtype = out.numel(), out.dtype
        view = payload if isinstance(payload, bytes) else memoryview(payload).cast("B")
        expected = self.encoded_size(numel, dtype)
        if len(view) != expected:
            raise CodecError(
                f"{self.name} payload for {numel} {wire_dtype_name(dtype)} elements must be {expected} bytes, "
                f"got {len(view)}: the stream was truncated or the sender used another codec"
            )
        if numel == 0:
            return
        if not dtype.is_floating_point:
            copy_raw_into(view, out)
            return
        if self._decode_float_into(view, out):
            return  # the codec proved every value finite while decoding
        require_finite(
            out,
            f"decoded {self.name} payload",
            "the payload is corrupt or the sender shipped NaN/Inf",
        )

    def encoded_size(self, numel: int, dtype: torch.dtype) -> int:
        """Exact number of bytes ``encode`` returns for ``numel`` elements of ``dtype``."""
        wire_dtype_name(dtype)  # raises CodecError for dtypes that cannot cross the wire
        if not isinstance(numel, int) or numel < 0:
            raise CodecError(f"element count must be a non-negative int, got {numel!r}")
        if not dtype.is_floating_point:
            return numel * dtype.itemsize
        return self._encoded_float_size(numel, dtype)

    def alignment(self, dtype: torch.dtype) -> int:
        """Segment alignment in elements for tensors of ``dtype``: 1 for raw non-floating dtypes, else
        ``segment_alignment``."""
        return self.segment_alignment if dtype.is_floating_point else 1

    @abc.abstractmethod
    def _encode_float(self, flat: torch.Tensor) -> bytes | memoryview:
        """Encode a validated 1-D contiguous floating tensor; must raise on NaN/Inf (see module docstring). May
        return a memoryview (see ``encode_view``)."""

    def _encode_finite(self, flat: torch.Tensor) -> bytes | memoryview:
        """``_encode_float`` of a tensor known to hold no NaN/Inf; codecs whose finite check is a pass of its own
        skip it here."""
        return self._encode_float(flat)

    @abc.abstractmethod
    def _decode_float_into(self, payload: bytes | memoryview, out: torch.Tensor) -> bool | None:
        """Decode a payload of the right length into ``out`` (1-D contiguous floating, numel > 0). Return True only
        if every decoded value is sure to be finite (``decode_into`` then skips its own check)."""

    @abc.abstractmethod
    def _encoded_float_size(self, numel: int, dtype: torch.dtype) -> int:
        """Payload bytes for ``numel`` elements of floating ``dtype``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _check_flat(flat: torch.Tensor) -> None:
    if not isinstance(flat, torch.Tensor):
        raise ValueError(f"codecs encode torch tensors, got {type(flat).__name__}")
    if flat.dim() != 1:
        raise ValueError(
            f"codecs encode flat tensors, got shape {tuple(flat.shape)}: pass tensor.reshape(-1)"
        )
    if flat.device.type != "cpu":
        raise ValueError(f"codecs encode CPU tensors, got one on {flat.device}: pass tensor.cpu()")
    if not flat.is_contiguous():
        raise ValueError(
            "codecs encode contiguous tensors, got a strided view: pass tensor.contiguous()"
        )
    wire_dtype_name(flat.dtype)


def raw_view(flat: torch.Tensor) -> memoryview:
    """The little-endian bytes of a 1-D contiguous CPU tensor, as a view of its memory (no copy)."""
    # numpy has no bfloat16: view those as bytes first (a torch op; the other dtypes need none)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def copy_raw_into(payload: bytes | memoryview, out: torch.Tensor) -> None:
    """Copy raw little-endian ``payload`` bytes into the 1-D contiguous tensor ``out`` of the same byte size."""
    # through numpy: it reads a read-only buffer without copying it first (torch.frombuffer would warn about
    # read-only memory), and the one copy lands in memory that ``out`` owns
    # (numpy's view as bytes, not torch's: a torch op on an event loop is a GIL handoff; numpy has no bfloat16)
    wide = out.view(torch.uint8) if out.dtype == torch.bfloat16 else out
    target = wide.numpy().view(np.uint8)
    target[:] = np.frombuffer(payload, dtype=np.uint8)
    if out.dtype == torch.bool and bool((target > 1).any()):
        raise CodecError("bool payload holds bytes other than 0 and 1: the payload is corrupt")


def tensor_from_raw(payload: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A new 1-D tensor of ``dtype`` holding a copy of ``payload`` (whose length is a multiple of itemsize)."""
    out = torch.empty(len(payload) // dtype.itemsize, dtype=dtype)
    copy_raw_into(payload, out)
    return out


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN/±Inf."""
    # fast path: a sum is finite only if every term is (NaN and ±Inf propagate, Inf - Inf is NaN), and summing is
    # ~10x faster than isfinite(); a non-finite sum may still be an overflow of finite terms, so check exactly then
    # (two torch ops, the sum and its read, where isfinite would add a third: each one on an event loop is a GIL
    # handoff)
    return math.isfinite(tensor.sum()) or bool(torch.isfinite(tensor).all())


def require_finite(tensor: torch.Tensor, what: str, hint: str) -> None:
    """Raise ``NonFiniteTensorError`` naming the count and first index of NaN/Inf values in ``tensor``."""
    if all_finite(tensor):
        return
    finite = torch.isfinite(tensor)
    bad = (~finite).reshape(-1).nonzero()  # (k, 1)
    raise NonFiniteTensorError(
        f"{what} holds {bad.numel()} non-finite values (NaN/Inf) out of {tensor.numel()}, "
        f"first at element {int(bad[0, 0])}: {hint}"
    )
