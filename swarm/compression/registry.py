"""Codec lookup by wire name."""

from __future__ import annotations

from swarm.compression.base import Codec
from swarm.compression.cast import BFloat16Codec, Float16Codec, NoneCodec
from swarm.compression.errors import UnknownCodecError
from swarm.compression.int8 import BlockwiseInt8Codec
from swarm.compression.lowbit import (
    BlockwiseInt2Codec,
    BlockwiseInt4Codec,
    StochasticInt2Codec,
    StochasticInt4Codec,
)
from swarm.compression.names import CODEC_NAMES

# codecs are stateless and thread-safe, so one shared instance each is enough
_CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        NoneCodec(),
        Float16Codec(),
        BFloat16Codec(),
        BlockwiseInt8Codec(),
        BlockwiseInt4Codec(),
        BlockwiseInt2Codec(),
        StochasticInt4Codec(),
        StochasticInt2Codec(),
    )
}

if tuple(_CODECS) != CODEC_NAMES:
    raise AssertionError(
        f"swarm.compression.names lists {CODEC_NAMES}, the codecs are {tuple(_CODECS)}"
    )


def get_codec(name: str) -> Codec:
    """The codec registered under ``name``; raises ``UnknownCodecError`` listing ``CODEC_NAMES``."""
    try:
        return _CODECS[name]
    except (KeyError, TypeError):
        raise UnknownCodecError(
            f"unknown codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}. Check the run config or upgrade "
            f"this peer if the run uses a newer codec"
        ) from None
