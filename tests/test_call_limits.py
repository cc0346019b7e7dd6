"""The bookkeeping that bounds what callers make a peer hold (swarm.peer.limits) and the drain of refused requests
(swarm.transport.server.drain_request), apart from a server: each open call reserves its receive window from the
request-memory budget, and at most MAX_DRAINS refused calls are read at once."""

from __future__ import annotations

import asyncio

import pytest

from swarm.errors import PeerOverloaded
from swarm.peer.config import LimitsConfig
from swarm.peer.limits import CallLimits, caller_address
from swarm.transport import server

pytestmark = pytest.mark.unit

WINDOW = 64 << 10


def test_every_open_call_reserves_its_receive_window_so_idle_streams_count_against_the_budget():
    limits = CallLimits(
        LimitsConfig(stream_window_bytes=WINDOW, request_memory_bytes=2 * WINDOW + 100)
    )
    with limits.call("ipv4:10.0.0.1") as first, limits.call("ipv4:10.0.0.2"):
        assert limits.reserved_bytes == 2 * WINDOW and first.nbytes == WINDOW
        with pytest.raises(PeerOverloaded, match="receive window") as refused:
            with limits.call("ipv4:10.0.0.3"):
                pass
        assert "--request-memory-bytes=131172" in str(refused.value)
        assert limits.open_streams("ipv4:10.0.0.3") == 0  # a refused call holds nothing
        first.reserve(100, "tensor 'input'")  # what is left after the windows still admits a tensor
        with pytest.raises(PeerOverloaded, match="tensor 'targets'"):
            first.reserve(1, "tensor 'targets'")
    assert limits.reserved_bytes == 0 and limits.open_streams("ipv4:10.0.0.1") == 0


def test_a_window_the_budget_cannot_hold_is_refused_at_start():
    with pytest.raises(ValueError, match="stream_window_bytes .* below request_memory_bytes"):
        LimitsConfig(stream_window_bytes=4 << 20, request_memory_bytes=4 << 20)
    with pytest.raises(ValueError, match="at least 65536"):
        LimitsConfig(stream_window_bytes=1024)


def test_one_caller_is_its_address_whatever_its_port():
    assert caller_address("ipv4:1.2.3.4:5678") == caller_address("ipv4:1.2.3.4:9") == "ipv4:1.2.3.4"
    assert caller_address("ipv6:[::1]:5678") == "ipv6:[::1]"


def test_refused_requests_are_drained_only_up_to_max_drains_at_once():
    """Each drained call reads what its caller still sends (so the caller sees the peer's status); past
    MAX_DRAINS at once, a refused call is answered undrained instead of holding another receive window."""

    async def main():
        reads = [0] * (server.MAX_DRAINS + 3)
        release = asyncio.Event()

        def endless(i: int):
            async def frames():
                while True:  # a caller that keeps sending
                    reads[i] += 1
                    yield _Frame()
                    await asyncio.sleep(0)
                    if release.is_set():
                        return

            return frames()

        drains = [
            asyncio.ensure_future(server.drain_request(endless(i), timeout_s=30, idle_s=5))
            for i in range(len(reads))
        ]
        while sum(1 for r in reads if r) < server.MAX_DRAINS:
            await asyncio.sleep(0)
        late = drains[server.MAX_DRAINS :]
        await asyncio.wait(late, timeout=5)
        assert all(d.done() for d in late)  # answered at once, nothing read
        assert reads[server.MAX_DRAINS :] == [0, 0, 0]
        assert all(not d.done() for d in drains[: server.MAX_DRAINS])
        # a refusal before any handler (an unauthenticated caller) is drained all the same: its client reads
        # UNAUTHENTICATED, not INTERNAL
        assert await _drained_frames(server, counted=False) == 1
        release.set()
        await asyncio.wait_for(asyncio.gather(*drains), 10)
        assert server._draining == 0
        # slots free again: the next refused call is drained
        assert await _drained_frames(server) == 1

    asyncio.run(main())


class _Frame:
    def ByteSize(self) -> int:
        return 1


async def _drained_frames(srv, *, counted: bool = True) -> int:
    read = 0

    async def frames():
        nonlocal read
        read += 1
        yield _Frame()

    await srv.drain_request(frames(), timeout_s=5, idle_s=1, counted=counted)
    return read
