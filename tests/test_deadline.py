"""swarm.deadline.timeout on Python 3.10 (its own form, exercised here on any version) behaves as 3.11's."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from swarm.deadline import timeout_310

pytestmark = pytest.mark.unit


def test_the_310_timeout_raises_timeout_error_lets_early_blocks_through_and_passes_other_cancellations():
    async def late():
        async with timeout_310(0.01):
            await asyncio.sleep(10)

    async def early():
        async with timeout_310(10):
            await asyncio.sleep(0)
        async with timeout_310(None):
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)  # the first block's timer is off: nothing cancels this task later
        return "done"

    async def cancelled_elsewhere():
        async def body():
            async with timeout_310(10):
                await asyncio.sleep(10)

        task = asyncio.ensure_future(body())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with pytest.raises(TimeoutError) as raised:
        asyncio.run(late())
    assert isinstance(raised.value, asyncio.TimeoutError)  # distinct classes on 3.10: both catch it
    assert asyncio.run(early()) == "done"
    asyncio.run(cancelled_elsewhere())


def test_the_package_and_its_tools_use_no_asyncio_api_that_python_3_10_lacks():
    """requires-python is >=3.10: asyncio.timeout and TaskGroup came in 3.11 (use swarm.deadline.timeout, gather)."""
    root = Path(__file__).resolve().parents[1]
    found = [
        f"{path.relative_to(root)}:{n}"
        for folder in ("swarm", "bench", "deploy", "tests")
        for path in sorted((root / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"asyncio\.(timeout|TaskGroup|Runner)\b", line)
        and path.name != "deadline.py"
        and "test_deadline" not in path.name
    ]
    assert not found, found
