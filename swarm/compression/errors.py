"""Errors raised by the wire codecs.

All of them subclass ``CodecError`` (a :class:`~swarm.errors.SwarmError`, and a ``ValueError``), so a server
maps every codec failure on remote input to one gRPC status (INVALID_ARGUMENT) with the message as the details
string.
"""

from __future__ import annotations

import grpc

from swarm.errors import SwarmError


class CodecError(SwarmError, ValueError):
    """A payload or a tensor cannot be encoded/decoded: wrong length, unknown dtype, garbage bytes.

    The message says what was expected, what was found, and what the caller should do about it. The same
    bytes fail the same way at any peer: not retried elsewhere.
    """

    code = grpc.StatusCode.INVALID_ARGUMENT
    retry_elsewhere = False


class UnknownCodecError(CodecError):
    """A codec name that this build does not know; the message lists the known ones."""


class NonFiniteTensorError(CodecError):
    """A tensor holds NaN or ±Inf, before encoding or after decoding.

    Peers never ship or accept non-finite values: one NaN activation poisons every gradient downstream, so
    failing loudly at the wire boundary is the only place where the culprit is still identifiable.
    """


class CodecOverflowError(CodecError):
    """A finite value does not fit the codec's wire format (e.g. |x| > 65504 for fp16)."""
