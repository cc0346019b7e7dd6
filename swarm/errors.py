"""The project's one error family, and its mapping to gRPC statuses.

Every error swarm raises on purpose is a :class:`SwarmError`. This module is the bottom floor (it imports only
grpc): the errors peers send each other are defined here; routing, codec and record errors subclass the family
in their own packages.

A peer raises one of the wire errors (:data:`WIRE_ERRORS`) while handling a call; the transport ends the call
with the class's status code, the message as details, and the class name as the trailing-metadata entry
:data:`ERROR_METADATA_KEY`. The client rebuilds the same class from that name (only names of
:data:`WIRE_ERRORS` are trusted) or, for a peer that sends no name, from the code alone. The trainer then
decides what to do (retry elsewhere, resend inputs, give up) from the type, never by parsing text.
"""

from __future__ import annotations

import grpc


class SwarmError(Exception):
    """Base class. ``code`` is the gRPC status a peer answers with; ``retry_elsewhere`` tells a trainer
    whether another peer of the same stage may succeed where this one failed; ``peer``: the peer that sent it,
    where the caller that gave up on the call says (swarm.trainer.pipeline)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retry_elsewhere: bool = True
    peer: str | None = None


class InvalidRequest(SwarmError):
    """The request itself is wrong (shape, dtype, codec, truncated or garbage payload). Sending it to
    another peer would fail the same way, so it is not retried."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    retry_elsewhere = False


class GradientOutlier(InvalidRequest):
    """A microbatch's gradient is far larger than the stage's recent ones (``--max-gradient-ratio``): the
    gradient the caller sent, or the input it came with, is corrupted. Nothing was accumulated. The caller
    computes the microbatch again without the peer that produced that gradient."""


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


class GradientsDropped(SwarmError):
    """A commit found no gradients held for its microbatch: they were dropped (the commit came after the
    peer's hold ran out, or the call ended before its reply was sent) or never computed here. Nothing was
    counted; the caller computes this stage's gradient again, here or at another peer."""

    code = grpc.StatusCode.ABORTED


class AllReduceFailed(SwarmError):
    """A part of a step's direct all-reduce could not complete (swarm.averaging.direct): a member's share did not
    come in time, or the part's owner has moved on. No member steps on it."""

    code = grpc.StatusCode.ABORTED


class PeerDraining(SwarmError):
    """The peer is shutting down (preemption) and takes no new work."""

    code = grpc.StatusCode.UNAVAILABLE


class PeerOverloaded(SwarmError):
    """The peer's queue or memory budget is full."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineUnmet(PeerOverloaded):
    """The peer did not start the work: the caller's deadline had passed, or the compute queued ahead of it
    would end after the deadline, or that queue is longer than the peer's ``--max-queue-wait-s`` (load
    shedding, see swarm.routing.shedding). The peer is healthy, only busy: the caller retries at another
    peer of the stage at once, without a ban."""


class StepPending(DeadlineUnmet):
    """A call pinned to an optimizer step this replica has not taken yet (its stage is averaging the batch before)
    waited for it as long as the caller's deadline allowed, and nothing was computed. No fault of the peer's: the
    caller waits for the stage's step and sends it again, at no cost to the call's retry budget (a trainer in
    lockstep sends a batch's first microbatches before it hears of the step; see Trainer._stages_caught_up)."""


class Unauthenticated(SwarmError):
    """The call carried no valid caller token (none, forged, expired, or made for another peer): the peer does
    not know who is calling. A caller with a valid identity may get in at another peer (or after fixing its
    clock: tokens are dated)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class NotAdmitted(SwarmError):
    """The caller is known but the peer's admission policy (``--allow-callers``) does not admit it."""

    code = grpc.StatusCode.PERMISSION_DENIED


class StreamTimeout(SwarmError):
    """The caller's request stream went silent, or trickled, past the peer's read deadlines; the call was cut."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class StageUnavailable(SwarmError):
    """No live peer serves a stage (after waiting as long as configured)."""

    code = grpc.StatusCode.UNAVAILABLE


class TransportError(SwarmError):
    """The call failed in transit: connection refused or reset, deadline passed, peer died mid-call."""

    code = grpc.StatusCode.UNAVAILABLE


class BadReply(TransportError):
    """A peer's reply failed the caller's checks (shape, dtype, non-finite values, a malformed frame): the
    peer is faulty or lying. Never sent on the wire: the caller raises it, bans the peer and retries."""


class UsageError(SwarmError, ValueError):
    """The caller's own input is wrong (a flag, a path, a data file): fixing it helps, retrying does not. A
    ``ValueError`` too, like the config checks of ``__post_init__``; the CLI exits with status 2 for both."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    retry_elsewhere = False


# The errors that cross the wire: a peer may send any of these names, and only these are rebuilt from a name.
WIRE_ERRORS: tuple[type[SwarmError], ...] = (
    SwarmError,
    InvalidRequest,
    WrongPeer,
    NotCached,
    AlreadyApplied,
    GradientsDropped,
    GradientOutlier,
    AllReduceFailed,
    PeerDraining,
    PeerOverloaded,
    DeadlineUnmet,
    StepPending,
    Unauthenticated,
    NotAdmitted,
    StreamTimeout,
    StageUnavailable,
    TransportError,
)
# Trailing-metadata key whose value names the error's class (one of WIRE_ERRORS).
ERROR_METADATA_KEY = "swarm-error"

_BY_NAME: dict[str, type[SwarmError]] = {cls.__name__: cls for cls in WIRE_ERRORS}
# For peers that send no name: the class of each code that only one wire error uses. UNAVAILABLE (draining,
# no peer, transport) and INTERNAL (a bug in the peer) fall back to TransportError: try another peer.
_BY_CODE: dict[grpc.StatusCode, type[SwarmError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: WrongPeer,
    grpc.StatusCode.FAILED_PRECONDITION: NotCached,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyApplied,
    grpc.StatusCode.ABORTED: GradientsDropped,
    grpc.StatusCode.RESOURCE_EXHAUSTED: PeerOverloaded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: NotAdmitted,
}


def wire_name(error: SwarmError) -> str | None:
    """The name a peer sends for ``error``: its class or nearest ancestor among :data:`WIRE_ERRORS` that has
    the same code. None when there is none (e.g. a codec error): the code alone then tells the caller."""
    return next(
        (
            cls.__name__
            for cls in type(error).__mro__
            if cls in WIRE_ERRORS and cls.code == error.code
        ),
        None,
    )


def error_from_status(
    code: grpc.StatusCode, details: str | None, *, name: str | None = None, peer: str = ""
) -> SwarmError:
    """Rebuild the typed error a peer raised from the status its call ended with and the class ``name`` it
    sent (see :data:`ERROR_METADATA_KEY`). A name outside :data:`WIRE_ERRORS`, or none, falls back to the
    code; the details text never chooses the class."""
    where = f"peer {peer}: " if peer else ""
    cls = _BY_NAME.get(name or "") or _BY_CODE.get(code, TransportError)
    text = details or code.name
    if name is None and code == grpc.StatusCode.DEADLINE_EXCEEDED:
        # the caller's own deadline ran out (grpc says just "Deadline Exceeded"): say it as a late reply reads
        text = f"no reply within the call's deadline ({text})"
    error = cls(f"{where}{text}")
    error.status = (
        code  # the status the call ended with (a deadline and a refused connection differ)
    )
    return error
