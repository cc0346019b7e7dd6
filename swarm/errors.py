"""Typed errors shared by peers and trainers, and their mapping to gRPC status codes.

A peer raises one of these while handling a call; the transport turns it into a gRPC status with the
message as details. The client turns the status back into the same class, so the trainer decides what to
do (retry elsewhere, resend inputs, give up) from the type, never by parsing text.
"""
from __future__ import annotations

import grpc


class SwarmError(Exception):
    """Base class. ``code`` is the gRPC status a peer answers with; ``retry_elsewhere`` tells a trainer
    whether another peer of the same stage may succeed where this one failed."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retry_elsewhere: bool = True


class InvalidRequest(SwarmError):
    """The request itself is wrong (shape, dtype, codec, truncated or garbage payload). Sending it to
    another peer would fail the same way, so it is not retried."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    retry_elsewhere = False


class WrongPeer(SwarmError):
    """The peer serves another run or stage (it may have moved since it was announced)."""

    code = grpc.StatusCode.NOT_FOUND


class NotCached(SwarmError):
    """Backward reached a peer that no longer holds the microbatch's inputs; resend them for a recompute."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyApplied(SwarmError):
    """This microbatch's gradient was already accumulated by this peer and its reply is no longer cached.
    The gradient counts once; the caller must not count the microbatch again."""

    code = grpc.StatusCode.ALREADY_EXISTS
    retry_elsewhere = False


class PeerDraining(SwarmError):
    """The peer is shutting down (preemption) and takes no new work."""

    code = grpc.StatusCode.UNAVAILABLE


class PeerOverloaded(SwarmError):
    """The peer's queue or memory budget is full."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StageUnavailable(SwarmError):
    """No live peer serves a stage (after waiting as long as configured)."""

    code = grpc.StatusCode.UNAVAILABLE


class TransportError(SwarmError):
    """The call failed in transit: connection refused or reset, deadline passed, peer died mid-call."""

    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE: dict[grpc.StatusCode, type[SwarmError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: WrongPeer,
    grpc.StatusCode.FAILED_PRECONDITION: NotCached,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyApplied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: PeerOverloaded,
}


def error_from_status(code: grpc.StatusCode, details: str | None, *, peer: str = "") -> SwarmError:
    """Rebuild the typed error a peer raised from the status its call ended with."""
    where = f"peer {peer}: " if peer else ""
    cls = _BY_CODE.get(code, TransportError)
    if cls is TransportError and code == grpc.StatusCode.UNAVAILABLE and details and "draining" in details:
        cls = PeerDraining
    return cls(f"{where}{details or code.name}")
