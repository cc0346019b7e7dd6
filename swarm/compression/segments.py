"""Cutting a flat tensor into independently encoded segments that respect a codec's alignment."""

from __future__ import annotations

import torch

from swarm.compression.base import Codec
from swarm.compression.dtypes import wire_dtype_name


def segment_ranges(
    codec: Codec, numel: int, dtype: torch.dtype, max_segment_bytes: int
) -> list[tuple[int, int]]:
    """Consecutive ``(start, stop)`` element ranges covering ``[0, numel)``, largest first-fit.

    Every range except the last spans a multiple of ``codec.alignment(dtype)`` elements, and every range encodes
    to at most ``max_segment_bytes`` bytes, so each can travel in its own message and be encoded/decoded
    independently (see ``Codec``). ``numel == 0`` gives an empty list. Raises ``ValueError`` if one aligned unit
    alone is larger than ``max_segment_bytes``.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    unit = codec.alignment(dtype)
    unit_bytes = codec.encoded_size(unit, dtype)
    units_per_segment = max_segment_bytes // unit_bytes
    if units_per_segment < 1:
        raise ValueError(
            f"max_segment_bytes={max_segment_bytes} is below one {codec.name} unit of {unit} "
            f"{wire_dtype_name(dtype)} elements ({unit_bytes} bytes): raise the segment size"
        )
    step = units_per_segment * unit
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]
