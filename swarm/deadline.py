"""``timeout(seconds)``: asyncio's ``async with asyncio.timeout(...)`` (Python 3.11+), and the same on Python 3.10.

On 3.10 the block's task is cancelled when the time is up and the cancellation comes out of the block as a
``TimeoutError`` (the builtin, as 3.11's, and also ``asyncio.TimeoutError``, which 3.10 keeps apart and its
``asyncio.wait_for`` raises); a cancellation from anywhere else passes through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

if asyncio.TimeoutError is TimeoutError:  # Python 3.11+: one class
    Expired = TimeoutError
else:

    class Expired(asyncio.TimeoutError, TimeoutError):
        """The 3.10 form's error: caught by ``except TimeoutError`` and by ``except asyncio.TimeoutError``."""


@contextlib.asynccontextmanager
async def timeout_310(delay: float | None) -> AsyncIterator[None]:
    """The 3.10 form (also usable on later versions): ``delay`` seconds (None: never)."""
    if delay is None:
        yield
        return
    task = asyncio.current_task()
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    handle = asyncio.get_running_loop().call_later(max(delay, 0.0), expire)
    try:
        yield
    except asyncio.CancelledError:
        if fired:
            raise Expired from None
        raise
    finally:
        handle.cancel()


timeout = asyncio.timeout if sys.version_info >= (3, 11) else timeout_310
