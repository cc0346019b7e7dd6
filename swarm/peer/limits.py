"""Budgets that keep one peer's memory and streams bounded whatever its callers send.

:class:`CallLimits` admits each streaming call: at most ``max_streams_per_caller`` open calls per caller
address, and every byte a call's request will allocate reserved from one shared ``request_memory_bytes``
budget: the call's receive window first (what gRPC buffers for an open stream before the peer reads a frame,
``stream_window_bytes``), then its tensors from their headers, before any payload is
received. So the streams a flood holds open count against the budget too. A call that does not fit is refused with
:class:`PeerOverloaded` (RESOURCE_EXHAUSTED), the status trainers answer by retrying at another peer. Pure
bookkeeping on the event loop (no locks: one loop per process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from swarm.errors import PeerOverloaded
from swarm.peer.config import LimitsConfig


class Reservation:
    """The request memory one call holds; released all at once when the call ends."""

    def __init__(self, limits: CallLimits):
        self._limits = limits
        self.nbytes = 0

    def reserve(self, nbytes: int, what: str) -> None:
        """Take ``nbytes`` more for ``what``, or raise PeerOverloaded if the peer's budget cannot spare them."""
        self._limits._take(nbytes, what)
        self.nbytes += nbytes


class CallLimits:
    def __init__(self, config: LimitsConfig):
        self.config = config
        self.reserved_bytes = 0  # request memory held by all calls now
        self._streams: dict[str, int] = {}  # caller address -> open calls

    def open_streams(self, caller: str) -> int:
        return self._streams.get(caller, 0)

    @contextlib.contextmanager
    def call(self, caller: str) -> Iterator[Reservation]:
        """Admit one call from ``caller`` (its address, see :func:`caller_address`) for the block."""
        open_now = self._streams.get(caller, 0)
        if open_now >= self.config.max_streams_per_caller:
            raise PeerOverloaded(
                f"{caller} already has {open_now} calls open at this peer "
                f"(--max-streams-per-caller={self.config.max_streams_per_caller}); finish some first"
            )
        reservation = Reservation(self)
        reservation.reserve(self.config.stream_window_bytes, "the call's receive window")
        self._streams[caller] = open_now + 1
        try:
            yield reservation
        finally:
            self.reserved_bytes -= reservation.nbytes
            left = self._streams[caller] - 1
            if left:
                self._streams[caller] = left
            else:
                del self._streams[caller]

    def _take(self, nbytes: int, what: str) -> None:
        budget = self.config.request_memory_bytes
        if self.reserved_bytes + nbytes > budget:
            raise PeerOverloaded(
                f"{what} needs {nbytes / 2**20:.1f} MiB and the calls in progress hold "
                f"{self.reserved_bytes / 2**20:.1f} MiB of this peer's --request-memory-bytes={budget}; "
                f"retry at another peer of the stage or later"
            )
        self.reserved_bytes += nbytes


def caller_address(peer: str) -> str:
    """The caller's address without its port, from gRPC's ``context.peer()`` ("ipv4:1.2.3.4:5678",
    "ipv6:[::1]:5678", "unix:..."): one caller opening many connections is still one caller."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer
