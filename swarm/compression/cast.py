"""Codecs that send each value as-is or cast to a 16-bit float: ``none``, ``fp16``, ``bf16``.

``none`` is lossless. ``fp16`` keeps ~3 significant digits for 6.1e-5 <= |x| <= 65504 (smaller values lose relative
precision and flush to zero below 6e-8; larger ones raise ``CodecOverflowError``). ``bf16`` keeps the float32 range
with ~2-3 significant digits, so it is the safer choice for gradients. Inputs that already are 16-bit floats travel
raw in both 16-bit codecs: re-rounding to the other 16-bit format would lose precision without saving a byte.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from swarm.compression.base import (
    Codec,
    all_finite,
    copy_raw_into,
    raw_view,
    require_finite,
    tensor_from_raw,
)
from swarm.compression.errors import CodecOverflowError

_ENCODE_HINT = (
    "find where the NaN/Inf appeared (loss scale, learning rate, bad batch) instead of shipping it"
)


class NoneCodec(Codec):
    """Lossless: the tensor's own little-endian bytes."""

    name: ClassVar[str] = "none"
    segment_alignment: ClassVar[int] = 1

    def _encode_float(self, flat: torch.Tensor) -> memoryview:
        require_finite(flat, "tensor to encode", _ENCODE_HINT)
        return raw_view(flat)

    def _encode_finite(self, flat: torch.Tensor) -> memoryview:
        return raw_view(flat)

    def _decode_float_into(self, payload: bytes | memoryview, out: torch.Tensor) -> None:
        copy_raw_into(payload, out)

    def _encoded_float_size(self, numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize


class _HalfCastCodec(Codec):
    """Round wider floats to ``wire_dtype`` (nearest-even); 16-bit inputs travel raw."""

    wire_dtype: ClassVar[torch.dtype]
    segment_alignment: ClassVar[int] = 1

    def _encode_float(self, flat: torch.Tensor) -> memoryview:
        if flat.dtype.itemsize <= 2:
            require_finite(flat, "tensor to encode", _ENCODE_HINT)
            return raw_view(flat)
        half = flat.to(self.wire_dtype)  # (N,)
        # checking the 2-byte result catches NaN/Inf inputs and overflow in one cheap pass; tell them apart
        # only on the failure path
        if not all_finite(half):
            require_finite(flat, "tensor to encode", _ENCODE_HINT)
            limit = torch.finfo(self.wire_dtype).max
            raise CodecOverflowError(
                f"tensor to encode has values up to {float(flat.abs().max()):.4g}, beyond the {self.name} "
                f"limit {limit:.4g}: use the bf16 or int8 codec, or scale the tensor down"
            )
        return raw_view(half)

    def _decode_float_into(self, payload: bytes | memoryview, out: torch.Tensor) -> None:
        if out.dtype.itemsize <= 2:
            copy_raw_into(payload, out)
        else:
            out.copy_(tensor_from_raw(payload, self.wire_dtype))  # widening is exact

    def _encoded_float_size(self, numel: int, dtype: torch.dtype) -> int:
        return numel * 2


class Float16Codec(_HalfCastCodec):
    """IEEE half precision: 2 bytes per value, range ±65504."""

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


class BFloat16Codec(_HalfCastCodec):
    """bfloat16: 2 bytes per value, float32 range, 8 significant bits."""

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
