"""Calls that wait for this replica's optimizer step: a trainer closing a global batch in lockstep asks to be
answered once the replica has stepped on it (``CloseBatch``'s ``wait_for_step_s``), so it learns of the step in
that one round trip instead of asking every replica again every few tens of milliseconds while the stage steps; and
the next batch's first calls, sent pinned to that step before the trainer hears of it, wait here for it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class StepWatch:
    """The replica's step, and the calls on its event loop waiting for it to pass a value."""

    def __init__(self, step: Callable[[], int]):
        # read on the event loop each time (a move swaps the executor that counts the steps)
        self._step = step
        self._changed = asyncio.Event()
        self.waiting = 0  # calls waiting in wait_past now

    def changed(self) -> None:
        """The step may have moved (the peer's step check ran): the waiting calls look again. Event loop only."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_past(self, step: int, timeout_s: float) -> int:
        """Wait until the replica's step is past ``step``, at most ``timeout_s``; the step then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self.waiting += 1
        try:
            while self._step() <= step and (left := deadline - loop.time()) > 0:
                changed = self._changed
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)
        finally:
            self.waiting -= 1
        return self._step()
