"""Whether this process's DHT node still works: its process alive, and answering.

hivemind runs a node in a child process and talks to it through a pipe. A call whose request the child never reads
(the child died, or the request was lost on its way: hivemind drops a request it cannot unpickle, and dies on some)
waits forever. A peer whose node is gone keeps serving what is in flight, but its records expire, so trainers stop
finding it, and whatever it asks the DHT (a stage's state, who is left) never comes back: it sits there, silent.

:class:`DHTWatch` says so, once: ``on_lost`` gets the reason when the node's process exits (its sentinel becomes
readable on the event loop, no polling) or when the node has answered none of the calls made through :meth:`ask`
for ``silent_s``. What to do then is the caller's (``swarm peer`` drains and exits non-zero, see
:meth:`swarm.peer.lifecycle.Peer.create`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from swarm.deadline import timeout

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The exit status of `swarm peer` and `swarm train` when they stopped because their DHT node was lost: a
# supervisor's cue to start them again.
EXIT_DHT_LOST = 3


class DHTLost(RuntimeError):
    """A peer's or trainer's DHT node died or stopped answering while it started (the message says which); start it
    again to rejoin."""


class DHTWatch:
    def __init__(self, dht, *, silent_s: float, on_lost: Callable[[str], None]):
        if silent_s <= 0:
            raise ValueError(f"silent_s must be positive, got {silent_s}")
        self._dht = dht
        self.silent_s = silent_s
        self._on_lost = on_lost
        self.lost: str | None = None  # why the node is lost (None: it is not)
        self._last_answer = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sentinel: int | None = None

    def start(self) -> None:
        """Watch the node's process from the running event loop (call on it)."""
        self._loop = asyncio.get_running_loop()
        self._sentinel = self._dht.sentinel  # readable once the process has exited
        self._loop.add_reader(self._sentinel, self._exited)

    def stop(self) -> None:
        """Stop watching (before shutting the node down, which ends its process on purpose)."""
        if self._loop is not None and self._sentinel is not None:
            self._loop.remove_reader(self._sentinel)
        self._sentinel = None

    def _exited(self) -> None:
        self.stop()  # the sentinel stays readable: one report
        # reap it, which sets its exit code (its pipes close a moment before it ends)
        self._dht.join(timeout=1.0)
        code = self._dht.exitcode
        how = (
            f"was killed by signal {-code}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        self._lose(f"its DHT process (pid {self._dht.pid}) {how}")

    async def ask(self, call: Awaitable[T], *, timeout_s: float) -> T:
        """Await a DHT call for at most ``timeout_s`` (asyncio.TimeoutError after it). An answer, whatever it says,
        shows the node works; a call that times out when nothing has been answered for ``silent_s`` loses it."""
        try:
            # (not asyncio.wait_for: on 3.11 it loses a cancellation that comes as the call ends, and a heartbeat
            # then beat on through its peer's shutdown)
            async with timeout(timeout_s):
                result = await call
        except asyncio.TimeoutError:
            silent = time.monotonic() - self._last_answer
            if silent >= self.silent_s:
                self._lose(f"its DHT node has answered nothing for {silent:.0f}s")
            raise
        self._last_answer = time.monotonic()
        return result

    def _lose(self, reason: str) -> None:
        if self.lost is not None:
            return
        self.lost = reason
        self._on_lost(reason)
