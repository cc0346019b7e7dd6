"""A push route names the addresses a peer will dial: only what a signed record of that stage announces passes
(swarm.peer.routecheck). The records here come from a stand-in for the DHT read, counted, on a clock the test sets."""

from __future__ import annotations

import asyncio

import pytest

from swarm.discovery.records import StageRecord
from swarm.peer.routecheck import KNOWN_FOR_S, MISS_READS, REREAD_S, RouteCheck
from swarm.states import PeerState

pytestmark = pytest.mark.unit

CONFIG = "cfg"


def record(peer_id: str, endpoint: str, cert: str = "C", config_hash: str = CONFIG) -> StageRecord:
    return StageRecord(
        peer_id=peer_id,
        endpoint=endpoint,
        stage=1,
        state=PeerState.SERVING,
        throughput=1.0,
        in_flight=0,
        step=0,
        config_hash=config_hash,
        tls_cert=cert,
    )


class Records:
    """What the DHT holds for stage 1 now, and how many times it was read."""

    def __init__(self):
        self.now, self.reads, self.records = 0.0, 0, {}

    async def read(self, stage: int) -> dict[str, StageRecord]:
        assert stage == 1
        self.reads += 1
        await asyncio.sleep(0)  # a read takes a turn of the loop: concurrent misses overlap
        return dict(self.records)

    async def sleep(self, seconds: float) -> None:
        self.now += seconds  # the check waits between reads: on this clock, at once
        await asyncio.sleep(0)

    def check(self) -> RouteCheck:
        return RouteCheck(self.read, config_hash=CONFIG, clock=lambda: self.now, sleep=self.sleep)


def test_only_the_announced_peer_at_its_endpoint_with_its_certificate_is_dialed():
    dht = Records()
    dht.records = {
        "a": record("a", "10.0.0.1:7000"),
        "x": record("x", "10.0.0.9:1", config_hash="other"),
    }
    check = dht.check()

    async def body():
        return [
            await check.refusal(1, "a", "10.0.0.1:7000", "C"),
            await check.refusal(1, "a", "192.168.1.1:22", "C"),
            await check.refusal(1, "a", "10.0.0.1:7000", "forged"),
            await check.refusal(1, "nobody", "192.168.1.1:22", "C"),
            await check.refusal(1, "x", "10.0.0.9:1", "C"),  # a peer of another config
        ]

    ok, moved, cert, unknown, other = asyncio.run(body())
    assert ok is None
    assert "announces endpoint 10.0.0.1:7000, not 192.168.1.1:22" in moved
    assert "another certificate" in cert
    assert "no record of stage 1" in unknown and "nobody" in unknown
    assert other is not None
    # each miss reads again, REREAD_S apart, MISS_READS times before refusing (4 misses after the first read)
    assert dht.reads == 1 + 4 * MISS_READS


def test_a_miss_rereads_at_most_once_a_second_and_concurrent_misses_share_the_reads():
    dht = Records()
    check = dht.check()

    async def misses(n):
        return await asyncio.gather(*(check.refusal(1, "late", "h:1", "C") for _ in range(n)))

    started = dht.now
    assert all(asyncio.run(misses(5)))
    assert dht.reads == MISS_READS  # shared by the 5 calls
    assert dht.now - started >= (MISS_READS - 1) * REREAD_S  # never two reads within REREAD_S

    async def announced_while_waiting():
        miss = asyncio.ensure_future(check.refusal(1, "late", "h:1", "C"))
        await asyncio.sleep(0)
        dht.records = {"late": record("late", "h:1")}  # it announces itself while the call waits
        return await miss

    assert asyncio.run(announced_while_waiting()) is None


def test_a_peer_whose_record_expired_stays_known_for_a_while_then_is_refused():
    dht = Records()
    dht.records = {"a": record("a", "h:1")}
    check = dht.check()
    assert asyncio.run(check.refusal(1, "a", "h:1", "C")) is None
    dht.records = {}  # it died; its record expired
    dht.now += KNOWN_FOR_S - 1
    assert asyncio.run(check.refusal(1, "a", "h:1", "C")) is None  # a route a few heartbeats old
    dht.now += 2
    assert asyncio.run(check.refusal(1, "a", "h:1", "C")) is not None


def test_a_failed_read_admits_nothing_new_and_raises_nothing():
    dht = Records()

    async def broken(stage):
        raise TimeoutError("the DHT did not answer")

    check = RouteCheck(broken, config_hash=CONFIG, clock=lambda: dht.now, sleep=dht.sleep)
    assert "no record of stage 1" in asyncio.run(check.refusal(1, "a", "h:1", "C"))
