"""How often a replica that averages directly writes its progress record (swarm.averaging.hivemind_private's
ThrottledEvent, which wakes hivemind's reporting thread): at once when it has not written for the interval, else
once at the interval's end for any number of reports meanwhile; at once again on shutdown. And how often it declares
a higher step as a state donor, and how often it reads its stage's records."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.utils import get_dht_time
from livepeers import averaging_replicas, until

from swarm.averaging.hivemind_private import ThrottledEvent
from swarm.averaging.optimizer import DIRECT_PROGRESS_REFRESH_S


def test_a_throttled_event_fires_at_once_then_once_per_interval_and_at_once_when_told():
    event = ThrottledEvent(0.3)
    event.set()
    assert event.is_set()  # nothing written for an interval: at once
    event.clear()
    event.set()
    event.set()  # joins the one put off
    assert not event.is_set()
    assert event.wait(timeout=10)  # at the interval's end
    event.clear()
    event.set()  # within the interval of the last: put off...
    assert not event.is_set()
    event.set_now()  # ...unless told now (a shutdown)
    assert event.is_set()
    event.clear()
    assert not event.wait(timeout=0.6)  # the put-off one was cancelled: it does not fire later


def test_an_unthrottled_event_is_an_event():
    event = ThrottledEvent(0.0)
    for _ in range(3):
        event.set()
        assert event.is_set()
        event.clear()


@pytest.mark.integration
def test_a_replica_averaging_directly_declares_a_higher_step_as_a_donor_at_most_once_per_interval(
    loop_thread, boot
):
    """A replica's state-sharing priority (its step: whom a newcomer downloads from) is a DHT store; a replica
    averaging directly raises it at every step, so a rise within DIRECT_PROGRESS_REFRESH_S of the last declaration
    waits for the next one past it. A fall (a doubtful replica ranking itself below its peers) is declared at once.
    Read back from the real DHT record newcomers read."""

    async def body():
        (replica,) = await averaging_replicas(1, "declare", boot, all_reduce="direct")
        averager = replica.executor.optimizer.opt.state_averager
        key = f"{averager.prefix}.all_averagers"

        async def declared() -> float | None:
            found, _ = await asyncio.to_thread(replica.dht.get, key, latest=True) or ({}, None)
            values = [float(v.value) for v in found.values() if v.value is not None]
            return values[0] if values else None

        async def shows(value: float) -> bool:
            return await declared() == value

        try:
            assert averager.declare_every_s == DIRECT_PROGRESS_REFRESH_S
            # long enough that the DHT reads below fall within it on a loaded machine
            averager.declare_every_s = 5.0
            averager._declared_at = -float("inf")  # whatever was declared at start
            declared_at = time.monotonic()
            averager.state_sharing_priority = 5
            await until(lambda: shows(5), "the first rise is declared at once", timeout_s=4)
            # within the interval: kept for the next declaration
            averager.state_sharing_priority = 6
            assert averager.state_sharing_priority == 6
            # a declaration takes ~10 ms on loopback: this one never went out
            await asyncio.sleep(0.5)
            assert await declared() == 5
            await asyncio.sleep(max(0.0, declared_at + 5.1 - time.monotonic()))
            averager.state_sharing_priority = 7  # past the interval: declared, the newest value
            await until(lambda: shows(7), "a rise past the interval is declared", timeout_s=10)
            averager.state_sharing_priority = 6.5  # a fall, within the interval: at once
            await until(lambda: shows(6.5), "a fall is declared at once", timeout_s=10)
        finally:
            await replica.shutdown()

    loop_thread.run(body(), timeout_s=120)


class _CountedReads:
    """A DHT whose ``get`` calls are counted (the tracker's thread reads the stage's records through it)."""

    def __init__(self, dht, key: str):
        self._dht, self._key, self.reads = dht, key, 0

    def get(self, key, *args, **kwargs):
        self.reads += key == self._key
        return self._dht.get(key, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._dht, name)


@pytest.mark.integration
def test_a_replica_averaging_directly_reads_its_stages_records_once_per_interval_unless_asked_sooner(
    loop_thread, boot
):
    """hivemind's tracker reads the stage's progress records as often as every ``min_refresh_period`` when it
    expects the batch to fill soon (five DHT reads a second per replica at tiny's pace). A replica averaging directly
    reads them every DIRECT_PROGRESS_REFRESH_S, peers or none, and at once when asked (a newcomer waiting to see its
    peers' step, a replica looking for a donor)."""

    async def body():
        replicas = await averaging_replicas(2, "reads", boot, all_reduce="direct")
        tracker = replicas[0].executor.optimizer.opt.tracker
        counted = tracker.dht = _CountedReads(tracker.dht, tracker.training_progress_key)
        try:
            assert tracker.read_every_s == DIRECT_PROGRESS_REFRESH_S
            tracker.read_soon()
            await until(lambda: counted.reads >= 1, "a read when asked", timeout_s=10)
            await until(
                lambda: tracker.global_progress.num_peers == 2, "both records read", timeout_s=30
            )
            # the read that saw both records scheduled the next one an interval later
            read_at = time.monotonic()
            reads = counted.reads
            ahead = tracker.global_progress.next_fetch_time - get_dht_time()
            assert DIRECT_PROGRESS_REFRESH_S - 1.0 < ahead <= DIRECT_PROGRESS_REFRESH_S
            await asyncio.sleep(max(0.0, read_at + ahead - 1.0 - time.monotonic()))
            assert counted.reads == reads, "read before its interval was over"
            tracker.read_soon()
            await until(lambda: counted.reads > reads, "a read when asked again", timeout_s=10)
        finally:
            for replica in replicas:
                await replica.shutdown()

    loop_thread.run(body(), timeout_s=120)
