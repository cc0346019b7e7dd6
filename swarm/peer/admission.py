"""Which calls a peer takes, and what it knows about the calls it is running.

Every call the service handles passes through :meth:`Admission.call`: refused while draining past the
notice window, failed or hung on purpose under fault injection, then counted open until it ends. Only the
part of a call that is work (:meth:`Admission.working`: its request all received, waiting for or running on
the compute thread, sending its reply) counts in flight, the load the peer announces: a caller holding an
idle stream open costs the peer no compute and must not make it look busy to the trainers choosing peers.
The peer's lifecycle reads the counts (its heartbeat's ``in_flight``) and waits on the open calls to drain
(:meth:`Admission.wait_until_drained`); nothing else writes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator

from swarm.errors import PeerDraining, PeerOverloaded, TransportError

logger = logging.getLogger(__name__)

# While draining, how long after the last call ends to look again: a backward queued behind the last call
# arrives in that time, and counts as a call rather than as quiet.
_SETTLE_S = 0.05
# While draining, how often to re-check the cached microbatches and the quiet time when no call ends.
_POLL_S = 0.2
# Seconds kept in hand before the drain deadline, for the checkpoint and the exit.
_DEADLINE_MARGIN_S = 1.0


class Admission:
    """Admits one peer's calls. ``clock`` is monotonic seconds (injected for tests); ``rng`` draws the
    injected failures."""

    def __init__(
        self,
        *,
        peer_id: str,
        drain_timeout_s: float,
        drain_notice_s: float,
        drain_idle_s: float,
        fail_probability: float = 0.0,
        hang_after_calls: int = 0,
        lose_commit_probability: float = 0.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.peer_id = peer_id
        self.drain_timeout_s, self.drain_notice_s, self.drain_idle_s = (
            drain_timeout_s,
            drain_notice_s,
            drain_idle_s,
        )
        self.fail_probability, self.hang_after_calls = fail_probability, hang_after_calls
        self.lose_commit_probability = lose_commit_probability
        self._rng, self._clock = rng or random.Random(), clock
        self._open = 0  # calls admitted and not yet ended (what a drain waits for)
        self._in_flight = 0  # of those, calls doing work (see working())
        self._idle = asyncio.Event()
        self._idle.set()
        self._last_call_at = clock()  # when a call last started or ended
        self._drain_started: float | None = None
        self.calls_seen = 0  # calls that reached fault injection (counts toward hang_after_calls)

    # ------------------------------------------------------------------ calls

    @property
    def in_flight(self) -> int:
        """Calls doing work right now (see :meth:`working`): the load the peer announces."""
        return self._in_flight

    @property
    def open_calls(self) -> int:
        """Calls admitted and not yet ended, idle ones included."""
        return self._open

    @property
    def quiet_s(self) -> float:
        """Seconds since a call last started or ended."""
        return self._clock() - self._last_call_at

    @property
    def accepts_new_work(self) -> bool:
        """False once draining and past the notice window (trainers have had time to see the state)."""
        if self._drain_started is None:
            return True
        return self._clock() - self._drain_started < self.drain_notice_s

    @contextlib.asynccontextmanager
    async def call(self, *, new_work: bool, stage_index: int) -> AsyncIterator[None]:
        """Admit one call to ``stage_index``: raise PeerDraining for new work past the drain notice, apply
        fault injection, then count the call in flight until the block ends."""
        if new_work and not self.accepts_new_work:
            raise PeerDraining(
                f"peer {self.peer_id} is draining (shutting down) and takes no new work; "
                f"send it to another peer of stage {stage_index}"
            )
        await self._inject_faults()
        self._open += 1
        self._last_call_at = self._clock()
        self._idle.clear()
        try:
            yield
        finally:
            self._open -= 1
            self._last_call_at = self._clock()
            if self._open == 0:
                self._idle.set()

    @contextlib.contextmanager
    def working(self, *, max_in_flight: int) -> Iterator[None]:
        """Count the block (a call's compute and reply, inside :meth:`call`) in flight. Raises PeerOverloaded
        when ``max_in_flight`` calls already are: the compute queue is full, the caller tries another peer."""
        if self._in_flight >= max_in_flight:
            raise PeerOverloaded(
                f"peer {self.peer_id} has {self._in_flight} calls queued or running on its compute thread "
                f"(--max-queued-calls={max_in_flight}); retry at another peer of the stage"
            )
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1

    def lose_commit(self) -> str | None:
        """Fault injection (off by default): whether to lose this call's commit, and how, a third of the time
        each: "before" it is applied (a broken stream), "after" (its confirmation lost), "late" (it came after
        the hold: the gradients are dropped); None: not lost."""
        if self.lose_commit_probability and self._rng.random() < self.lose_commit_probability:
            return self._rng.choice(("before", "after", "late"))
        return None

    async def _inject_faults(self) -> None:
        """Fault injection (off by default): fail or hang calls as configured, for tests and benchmarks."""
        self.calls_seen += 1
        if self.hang_after_calls and self.calls_seen > self.hang_after_calls:
            await asyncio.Event().wait()  # never answers; the caller's deadline ends the call
        if self.fail_probability and self._rng.random() < self.fail_probability:
            raise TransportError(
                f"injected fault: peer {self.peer_id} fails this call on purpose "
                f"(--fail-probability {self.fail_probability})"
            )

    # ------------------------------------------------------------------ draining

    def begin_drain(self) -> None:
        """Start the drain window: new work is still taken for ``drain_notice_s``, then refused."""
        self._drain_started = self._clock()

    def end_drain(self) -> None:
        """Take new work again (the peer finished a move and serves its new stage)."""
        self._drain_started = None

    @property
    def drain_left_s(self) -> float:
        """Seconds left of ``drain_timeout_s`` (the whole timeout when not draining)."""
        if self._drain_started is None:
            return self.drain_timeout_s
        return self._drain_started + self.drain_timeout_s - self._clock()

    async def wait_until_drained(self, cached_microbatches: Callable[[], int]) -> int:
        """After :meth:`begin_drain`, wait until the notice window is over, no call is in flight and no
        microbatch waits for its backward (``cached_microbatches()``), or until the calls stop for
        ``drain_idle_s`` (whoever ran those forwards is gone), or until the drain deadline. Returns the
        number of cached microbatches given up on (0 when drained cleanly)."""
        if self._drain_started is None:
            raise RuntimeError("wait_until_drained needs begin_drain first")
        deadline = self._drain_started + self.drain_timeout_s - _DEADLINE_MARGIN_S
        while self._clock() < deadline:
            if not self.accepts_new_work and self._open == 0:
                cached = cached_microbatches()
                if cached == 0:
                    return 0
                if self.quiet_s >= self.drain_idle_s:
                    logger.info(
                        "peer %s drops %d cached microbatches: no call for %.1fs",
                        self.peer_id,
                        cached,
                        self.quiet_s,
                    )
                    return cached
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._settled(), timeout=_POLL_S)
        return cached_microbatches()

    async def _settled(self) -> None:
        await self._idle.wait()
        await asyncio.sleep(_SETTLE_S)
