"""Validated dtype names for the wire.

A request names its tensor dtype as a string; only the dtypes below cross the wire. Anything else from a remote
peer is garbage or a newer protocol, and is rejected with the allowed list rather than passed to ``getattr(torch,
...)``, which would happily resolve names like ``"nn"``.
"""

from __future__ import annotations

import torch

from swarm.compression.errors import CodecError

# Wire name -> dtype. Floating dtypes are the ones codecs may compress; the rest always travel raw.
_WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in _WIRE_DTYPES.items()}

WIRE_DTYPE_NAMES: tuple[str, ...] = tuple(_WIRE_DTYPES)


def wire_dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype`` (e.g. ``torch.float32`` -> ``"float32"``).

    Raises ``CodecError`` for dtypes that cannot cross the wire (complex, quantized, float8, ...).
    """
    try:
        return _NAMES_BY_DTYPE[dtype]
    except (KeyError, TypeError):
        raise CodecError(
            f"dtype {dtype!r} cannot be sent over the wire; supported dtypes: {', '.join(WIRE_DTYPE_NAMES)}. "
            f"Cast the tensor to one of them before sending it"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype for a wire name received from a peer; raises ``CodecError`` listing the allowed names."""
    try:
        return _WIRE_DTYPES[name]
    except (KeyError, TypeError):
        raise CodecError(
            f"unknown wire dtype {name!r}; allowed: {', '.join(WIRE_DTYPE_NAMES)}. "
            f"The sender runs an incompatible swarm version or the message is corrupt"
        ) from None
