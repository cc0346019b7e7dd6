"""The peer's single compute thread, with two priorities.

All of a replica's torch work runs on one thread, so an optimizer step never races a forward or backward.
Urgent jobs (committing held gradients, dropping aborted ones, snapshots) are cheap and go ahead of queued
compute: a commit waits for at most the job running now, not for the whole queue, so a slow or busy peer
still confirms commits before its callers' deadlines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

URGENT, NORMAL = 0, 1


class PriorityWorker:
    def __init__(self, name: str):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # FIFO within one priority
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, fn: Callable[..., Any], *args, priority: int = NORMAL, **kwargs
    ) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the compute worker is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((priority, next(self._order), future, fn, args, kwargs))
        return future

    async def compute(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run ``fn`` on the compute thread, after the jobs queued before it."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    async def compute_urgent(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run a cheap ``fn`` on the compute thread ahead of queued compute (commits, snapshots, steps)."""
        return await asyncio.wrap_future(self.submit(fn, *args, priority=URGENT, **kwargs))

    def submit_urgent(self, fn: Callable[..., Any], *args, **kwargs) -> None:
        """Queue a cheap ``fn`` ahead of compute without waiting (cleanup that must not be cancelled)."""
        self.submit(fn, *args, priority=URGENT, **kwargs)

    def _run(self) -> None:
        while True:
            _, _, future, fn, args, kwargs = self._queue.get()
            if fn is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # delivered to the awaiting coroutine
                future.set_exception(e)

    def shutdown(self) -> None:
        """Stop after the job running now; queued jobs are cancelled."""
        self._closed = True
        while True:
            try:
                _, _, future, fn, _, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.cancel()
        self._queue.put((-1, -1, None, None, (), {}))
        self._thread.join(timeout=30)
