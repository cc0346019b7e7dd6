"""Tensor codecs for the wire: ``none``, ``fp16``, ``bf16``, blockwise ``int8``, ``int4`` and ``int2`` (and ``int4sr``,
``int2sr``: 4 and 2 bits with stochastic rounding).

Usage: ``codec = get_codec(request.codec)``; ``payload = codec.encode(flat)`` on the sender and
``codec.decode(payload, numel, dtype_from_name(request.dtype))`` (or ``codec.decode_into(payload, out_slice)``) on
the receiver. Codecs work on flat 1-D CPU tensors so the transport can cut a tensor into segments
(``segment_ranges``, multiples of ``segment_alignment``) and overlap encode, transfer and decode; running them off
the event loop is the caller's job (the work is CPU-bound torch code that mostly releases the GIL).

NaN/Inf policy, the same for every codec: ``encode`` raises ``NonFiniteTensorError`` for a tensor with NaN/±Inf
and ``CodecOverflowError`` for finite values the format cannot hold; ``decode`` raises ``NonFiniteTensorError``
when a payload decodes to NaN/±Inf. A peer therefore never ships nor accepts non-finite values. Non-floating
dtypes always travel losslessly as raw little-endian bytes. Contracts in detail: ``swarm.compression.base``.
"""

from typing import TYPE_CHECKING

from swarm.compression.errors import (
    CodecError,
    CodecOverflowError,
    NonFiniteTensorError,
    UnknownCodecError,
)
from swarm.compression.names import BYTES_PER_VALUE, CODEC_NAMES
from swarm.lazy import lazy_exports

if TYPE_CHECKING:
    from swarm.compression.base import Codec
    from swarm.compression.cast import BFloat16Codec, Float16Codec, NoneCodec
    from swarm.compression.dtypes import WIRE_DTYPE_NAMES, dtype_from_name, wire_dtype_name
    from swarm.compression.int8 import BlockwiseInt8Codec
    from swarm.compression.lowbit import (
        BlockwiseInt2Codec,
        BlockwiseInt4Codec,
        StochasticInt2Codec,
        StochasticInt4Codec,
    )
    from swarm.compression.registry import get_codec
    from swarm.compression.segments import segment_ranges

# The codecs themselves are torch code, imported on first use (the names above are not).
__getattr__ = lazy_exports(
    globals(),
    {
        "Codec": "swarm.compression.base",
        "BFloat16Codec": "swarm.compression.cast",
        "Float16Codec": "swarm.compression.cast",
        "NoneCodec": "swarm.compression.cast",
        "WIRE_DTYPE_NAMES": "swarm.compression.dtypes",
        "dtype_from_name": "swarm.compression.dtypes",
        "wire_dtype_name": "swarm.compression.dtypes",
        "BlockwiseInt8Codec": "swarm.compression.int8",
        "BlockwiseInt4Codec": "swarm.compression.lowbit",
        "BlockwiseInt2Codec": "swarm.compression.lowbit",
        "StochasticInt4Codec": "swarm.compression.lowbit",
        "StochasticInt2Codec": "swarm.compression.lowbit",
        "get_codec": "swarm.compression.registry",
        "segment_ranges": "swarm.compression.segments",
    },
)

__all__ = [
    "BYTES_PER_VALUE",
    "CODEC_NAMES",
    "WIRE_DTYPE_NAMES",
    "BFloat16Codec",
    "BlockwiseInt2Codec",
    "BlockwiseInt4Codec",
    "BlockwiseInt8Codec",
    "Codec",
    "CodecError",
    "CodecOverflowError",
    "Float16Codec",
    "NonFiniteTensorError",
    "NoneCodec",
    "StochasticInt2Codec",
    "StochasticInt4Codec",
    "UnknownCodecError",
    "dtype_from_name",
    "get_codec",
    "segment_ranges",
    "wire_dtype_name",
]
