"""Blockwise 4-bit and 2-bit codecs (``int4``, ``int2``) and their stochastic-rounding twins (``int4sr``, ``int2sr``).

The flat tensor is cut into blocks of ``BLOCK_SIZE`` = 32 elements (the last may be shorter), as in ``int8``. Each
block is quantized to ``bits``-bit codes on one of two grids, and the grid is named by the sign bit of the
block's scale (a scale is never negative, so the bit is free)::

    sign 0, "centred" grid: 2**bits - 1 levels  q * s / Q,          q in [-Q, Q], Q = 2**(bits-1) - 1
    sign 1, "midrise" grid: 2**bits levels      (q + 1/2) * s / H,  q in [-H, H), H = 2**(bits-1) - 1/2

``s`` (the magnitude of the outermost level) is a bfloat16 rounded up, as in ``int8``. The centred grid holds an
exact zero, so a block where one outlier sets the scale keeps its many small values near zero (heavy tails: a
Student-t block with 2 bits has 3x less error there than on the midrise grid). The midrise grid uses every code;
for bell-shaped blocks it is the better one (at 2 bits it is nearly the Lloyd-Max quantizer of a normal
distribution, levels at +-0.5 and +-1.5 steps). A block takes the midrise grid when ``max |x| < 4 rms(x)``,
else the centred one: on 1M samples of normal, Student-t (df 2 and 4) and Laplace data that rule is within 3%
of picking, per block, the grid with the smaller squared error, for one quantization pass instead of two.
Scales, measured on the same samples:

* centred: ``s = max |x|`` (nothing is clipped);
* midrise: ``s = min(max |x|, c * rms(x))`` with c = 1.5 at 2 bits (the normal distribution's optimal outer level
  is 1.51 sigma, so a few large values are clipped to it) and ``s = max |x|`` at 4 bits (there the outer level of
  a 32-value block's maximum is already close to optimal).

Codes are stored offset to be non-negative (``q + 2**(bits-1)``; code 0 is unused on the centred grid) and
packed little-end first: two 4-bit codes per byte, four 2-bit codes per byte. Wire layout, block after block::

    [scale: bfloat16 little-endian, 2 bytes, sign = grid][packed codes: ceil(n * bits / 8) bytes] ...

so a full block is 2 + 16 bytes at 4 bits (4.5 bits per value, 7.1x smaller than float32) and 2 + 8 bytes at 2
bits (2.5 bits per value, 12.8x smaller). Every block carries its own scale, so segments cut at multiples of 32
elements encode to the same bytes as the whole tensor.

Stochastic rounding (``int4sr``, ``int2sr``) rounds each value up or down to a neighbouring level with the
probability that makes its expectation exact (values inside the grid's range), so the quantization error is
unbiased rather than minimal; averaged over many gradients the bias of round-to-nearest (small values always
lost at 2 bits) goes away. The dither is not a generator's state but the value's own 16 low mantissa bits
(effectively random for real-valued data) plus a fixed offset per position in the block: encoding stays a pure
function of the input (thread-safe; segments equal the whole), and values without low bits (0.5, small
integers) are still spread by their positions. Values the 2-bit midrise grid clips are biased by the clipping.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch

from swarm.compression.base import Codec, require_finite, tensor_from_raw
from swarm.compression.int8 import bfloat16_at_least, copy_saturating, raise_scale_overflow

_SCALE_BYTES = 2  # one bfloat16 per block; its sign bit names the grid
# blocks whose max |x| is below _SMALL (above _LARGE) are scaled by _LIFT (1 / _LIFT) while quantized
_SMALL = 2.0**-40
_LARGE = 2.0**40
_LIFT = 2.0**100
_SIGN_BIT = -32768  # int16 0x8000
# 2-bit midrise grid: the outer level at 1.5 * rms of the block at most (see the module docstring)
_MIDRISE_RMS_FACTOR = {2: 1.5, 4: None}
# a block whose max |x| is below this many rms takes the midrise grid, otherwise the centred one
_MIDRISE_MAX_OVER_RMS = 4.0


class BlockwiseLowBitCodec(Codec):
    """``bits``-bit codes (4 or 2) on a per-block choice of two grids, one bfloat16 scale per 32-element block."""

    bits: ClassVar[int]
    stochastic: ClassVar[bool] = False
    BLOCK_SIZE: ClassVar[int] = 32
    segment_alignment: ClassVar[int] = BLOCK_SIZE

    @classmethod
    def _per_byte(cls) -> int:
        return 8 // cls.bits

    @classmethod
    def _packed_bytes(cls, count: int) -> int:
        return -(-count // cls._per_byte())

    def _encoded_float_size(self, numel: int, dtype: torch.dtype) -> int:
        full, tail = divmod(numel, self.BLOCK_SIZE)
        size = full * (_SCALE_BYTES + self._packed_bytes(self.BLOCK_SIZE))
        if tail:
            size += _SCALE_BYTES + self._packed_bytes(tail)
        return size

    def _encode_float(self, flat: torch.Tensor) -> memoryview:
        work = flat if flat.dtype == torch.float64 else flat.float()  # (N,)
        out = torch.empty(self._encoded_float_size(flat.numel(), flat.dtype), dtype=torch.uint8)
        for blocks, rows in self._block_views(work, out):
            self._quantize_into(blocks, rows, flat)
        return memoryview(out.numpy())

    def _decode_float_into(self, payload: bytes | memoryview, out: torch.Tensor) -> None:
        data = tensor_from_raw(
            payload, torch.uint8
        )  # private copy: the payload may be read-only or reused
        work_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
        work = out if out.dtype == work_dtype else torch.empty(out.numel(), dtype=work_dtype)
        for blocks, rows in self._block_views(work, data):
            self._dequantize_into(rows, blocks)
        copy_saturating(work, out)

    def _block_views(
        self, values: torch.Tensor, payload: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield matching ``(blocks (nb, b), rows (nb, 2 + packed))`` views for the full blocks, then the tail."""
        block = self.BLOCK_SIZE
        row = _SCALE_BYTES + self._packed_bytes(block)
        num_full = values.numel() // block
        if num_full:
            yield (
                values[: num_full * block].view(num_full, block),
                payload[: num_full * row].view(num_full, row),
            )
        tail = values.numel() - num_full * block
        if tail:
            yield values[num_full * block :].view(1, tail), payload[num_full * row :].view(1, -1)

    # ------------------------------------------------------------------ encode

    def _quantize_into(
        self, blocks: torch.Tensor, rows: torch.Tensor, original: torch.Tensor
    ) -> None:
        """Quantize ``blocks`` (nb, b) into payload ``rows`` (nb, 2 + packed) uint8, in place."""
        absmax = blocks.abs().amax(dim=1).to(torch.float32)  # (nb,); NaN propagates, Inf stays Inf
        if not bool(torch.isfinite(absmax).all()):
            require_finite(
                original,
                "tensor to encode",
                "find where the NaN/Inf appeared instead of shipping it",
            )
            raise_scale_overflow(
                original, self.name
            )  # finite float64 values beyond the float32 range
        # Blocks far from 1 in magnitude are first scaled by an exact power of two, chosen per block (so a block
        # encodes the same whatever segment it travels in): below 2**-40 the sum of squares of the rms would
        # underflow float32 and the multiplier levels / scale overflow it; above 2**40 the sum of squares would
        # overflow. Everything up to the scale's rounding is then computed in these lifted units.
        lift = torch.where(
            absmax < _SMALL, _LIFT, torch.where(absmax > _LARGE, 1 / _LIFT, 1.0)
        )  # (nb,)
        if bool((lift != 1).any()):
            blocks = blocks * lift.to(blocks.dtype)[:, None]
            absmax_lifted = absmax * lift
        else:
            absmax_lifted = absmax
        rms = torch.linalg.vector_norm(blocks, dim=1).to(torch.float32)
        rms.mul_(blocks.shape[1] ** -0.5)  # (nb,) lifted
        # all-zero blocks have absmax == rms == 0 and take the centred grid
        use_midrise = absmax_lifted < _MIDRISE_MAX_OVER_RMS * rms  # (nb,)
        factor = _MIDRISE_RMS_FACTOR[self.bits]
        if factor is not None:
            midrise_scale = torch.minimum(absmax, rms.mul_(factor) / lift)  # (nb,) original units
            absmax = torch.where(use_midrise, midrise_scale, absmax)
        scale = bfloat16_at_least(absmax)  # (nb,)
        if not bool(torch.isfinite(scale).all()):
            raise_scale_overflow(original, self.name)

        half = 2 ** (self.bits - 1)
        # levels per unit of scale: Q = half - 1 (centred) or H = half - 1/2 (midrise)
        levels = torch.where(use_midrise, half - 0.5, half - 1.0)  # (nb,)
        wide = scale.to(torch.float32) * lift  # (nb,) in the units of the (lifted) blocks
        multiplier = torch.where(wide > 0, levels / wide, 0.0).to(blocks.dtype)  # (nb,)
        # code = floor(x / step + half - shift + u): shift = 1/2 puts the midrise levels on integers, and u is
        # 1/2 (round to nearest) or the dither (stochastic rounding)
        codes = blocks * multiplier[:, None]  # (nb, b)
        if self.stochastic:
            codes.add_(_dither(blocks)).add_(
                torch.where(use_midrise, half - 0.5, float(half)).to(blocks.dtype)[:, None]
            )
        else:
            codes.add_(torch.where(use_midrise, float(half), half + 0.5).to(blocks.dtype)[:, None])
        # clamp, then floor: a value a hair past the outermost level (rounding), or clipped on the midrise grid,
        # takes the outermost code; codes are then exact small integers held as floats
        codes.clamp_(0, 2**self.bits - 1).floor_()
        scale_bits = scale.view(torch.int16) | torch.where(use_midrise, _SIGN_BIT, 0).to(
            torch.int16
        )
        rows[:, :_SCALE_BYTES] = scale_bits.view(torch.uint8).view(-1, _SCALE_BYTES)
        rows[:, _SCALE_BYTES:] = self._pack(codes)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """(nb, b) integer-valued float codes < 2**bits -> (nb, ceil(b * bits / 8)) uint8, the first code in the
        lowest bits. Combined as floats (exact below 2**24), then converted once."""
        per_byte = self._per_byte()
        count = codes.shape[1]
        padded = self._packed_bytes(count) * per_byte
        if padded != count:
            codes = torch.nn.functional.pad(codes, (0, padded - count))
        width = self.bits
        while codes.shape[1] > self._packed_bytes(
            count
        ):  # pair neighbours until one value per byte is left
            pairs = codes.view(codes.shape[0], -1, 2)  # (nb, n / 2, 2)
            codes = torch.add(pairs[:, :, 0], pairs[:, :, 1], alpha=2**width)
            width *= 2
        return codes.to(torch.uint8)

    # ------------------------------------------------------------------ decode

    def _dequantize_into(self, rows: torch.Tensor, blocks: torch.Tensor) -> None:
        """Decode payload ``rows`` (nb, 2 + packed) uint8 into ``blocks`` (nb, b), in place."""
        scale_bits = rows[:, :_SCALE_BYTES].reshape(-1).clone().view(torch.int16)  # (nb,)
        use_midrise = scale_bits < 0  # the sign bit names the grid
        scale = (scale_bits & 0x7FFF).view(torch.bfloat16).to(blocks.dtype)  # (nb,)
        half = 2 ** (self.bits - 1)
        # value = (code - offset) * step, offset = half (centred) or half - 1/2 (midrise); a NaN/Inf scale decodes
        # to NaN/Inf, which Codec.decode_into refuses
        step = scale / torch.where(use_midrise, half - 0.5, half - 1.0).to(blocks.dtype)  # (nb,)
        bias = step * -torch.where(use_midrise, half - 0.5, float(half)).to(blocks.dtype)  # (nb,)
        self._unpack_into(rows[:, _SCALE_BYTES:], blocks)
        blocks.mul_(step[:, None]).add_(bias[:, None])

    def _unpack_into(self, packed: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write the codes of ``packed`` (nb, bytes) uint8 into ``blocks`` (nb, b) as floats."""
        per_byte = self._per_byte()
        mask = (1 << self.bits) - 1
        count = blocks.shape[1]
        if count == packed.shape[1] * per_byte:
            target = blocks.view(blocks.shape[0], -1, per_byte)  # (nb, bytes, per_byte)
        else:  # a short tail block: unpack its padding too, then keep the codes that exist
            target = torch.empty(packed.shape[0], packed.shape[1], per_byte, dtype=blocks.dtype)
        for i in range(per_byte):
            part = packed if i == 0 else packed >> (i * self.bits)
            target[:, :, i] = part & mask if i < per_byte - 1 else part
        if target.data_ptr() != blocks.data_ptr():
            blocks.copy_(target.view(packed.shape[0], -1)[:, :count])


def _dither(blocks: torch.Tensor) -> torch.Tensor:
    """Uniform-ish [0, 1) numbers (nb, b) from each value's own low mantissa bits plus a fixed offset per position
    in the block: a pure function of the block (thread-safe; segments encode like the whole), unrelated across
    neighbours, and nearly free. Real-valued data has effectively random low mantissa bits; for values that have
    none (small integers, 0.5, ...), the per-position offsets still spread the rounding."""
    low = blocks.to(torch.float32).view(torch.int32) & 0xFFFF  # (nb, b)
    offsets = _POSITION_OFFSETS[: blocks.shape[1]].to(blocks.dtype)  # (b,)
    return low.to(blocks.dtype).mul_(2.0**-16).add_(offsets).frac_()


# offsets k * golden ratio mod 1: evenly spread over [0, 1) for any prefix of positions
_POSITION_OFFSETS = (
    torch.arange(BlockwiseLowBitCodec.BLOCK_SIZE, dtype=torch.float64) * 0.6180339887498949
).frac()


class BlockwiseInt4Codec(BlockwiseLowBitCodec):
    name: ClassVar[str] = "int4"
    bits: ClassVar[int] = 4


class BlockwiseInt2Codec(BlockwiseLowBitCodec):
    name: ClassVar[str] = "int2"
    bits: ClassVar[int] = 2


class StochasticInt4Codec(BlockwiseLowBitCodec):
    name: ClassVar[str] = "int4sr"
    bits: ClassVar[int] = 4
    stochastic: ClassVar[bool] = True


class StochasticInt2Codec(BlockwiseLowBitCodec):
    name: ClassVar[str] = "int2sr"
    bits: ClassVar[int] = 2
    stochastic: ClassVar[bool] = True
