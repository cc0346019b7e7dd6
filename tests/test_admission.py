"""Admission: the drain window, in-flight/idle accounting and fault injection, on a clock the test moves."""

from __future__ import annotations

import asyncio
import random

import pytest

from swarm.errors import PeerDraining, PeerOverloaded, TransportError
from swarm.peer.admission import Admission


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def admission(clock: Clock, **overrides) -> Admission:
    kwargs = dict(
        peer_id="p1", drain_timeout_s=30.0, drain_notice_s=3.0, drain_idle_s=5.0, clock=clock
    )
    return Admission(**{**kwargs, **overrides})


def test_new_work_is_refused_only_past_the_drain_notice():
    clock = Clock()
    adm = admission(clock)

    async def body():
        assert adm.accepts_new_work
        adm.begin_drain()
        clock.now += 2.9
        # trainers may not have seen the state yet
        async with adm.call(new_work=True, stage_index=1):
            pass
        clock.now += 0.1
        assert not adm.accepts_new_work
        with pytest.raises(PeerDraining, match="peer p1 is draining.*another peer of stage 1"):
            async with adm.call(new_work=True, stage_index=1):
                pass
        async with adm.call(new_work=False, stage_index=1):  # backward for its own microbatches
            pass
        adm.end_drain()  # a move is over: the new stage takes work
        assert adm.accepts_new_work and adm.drain_left_s == 30.0

    asyncio.run(body())


def test_calls_are_counted_open_only_their_work_in_flight_and_they_reset_the_quiet_time():
    clock = Clock()
    adm = admission(clock)

    async def body():
        async with adm.call(new_work=True, stage_index=0):
            async with adm.call(new_work=True, stage_index=0):
                assert (adm.open_calls, adm.in_flight) == (2, 0)  # open, idle: no load
                with adm.working(max_in_flight=1):
                    assert adm.in_flight == 1
                    with pytest.raises(PeerOverloaded, match="--max-queued-calls=1"):
                        with adm.working(max_in_flight=1):
                            pass
                assert adm.in_flight == 0
            assert adm.open_calls == 1
            clock.now += 7.0
        assert adm.open_calls == 0 and adm.quiet_s == 0.0
        with pytest.raises(ValueError):
            async with adm.call(new_work=True, stage_index=0):
                raise ValueError("a failing call still ends")
        assert adm.open_calls == 0

    asyncio.run(body())


def test_fault_injection_fails_and_hangs_calls_as_configured():
    async def body():
        failing = admission(Clock(), fail_probability=1.0, rng=random.Random(0))
        with pytest.raises(TransportError, match="injected fault: peer p1.*--fail-probability 1.0"):
            async with failing.call(new_work=True, stage_index=0):
                pass
        assert failing.in_flight == 0

        hanging = admission(Clock(), hang_after_calls=1)
        async with hanging.call(new_work=True, stage_index=0):
            pass

        async def second_call():
            async with hanging.call(new_work=True, stage_index=0):
                pass

        with pytest.raises(asyncio.TimeoutError):  # never answers: the caller's deadline ends it
            await asyncio.wait_for(second_call(), timeout=0.1)
        assert hanging.calls_seen == 2 and hanging.in_flight == 0

    asyncio.run(body())


def test_draining_ends_when_no_call_and_no_cached_microbatch_is_left():
    clock = Clock()
    adm = admission(clock, drain_notice_s=0.0)

    async def body():
        cached = [2]
        adm.begin_drain()
        async with adm.call(new_work=False, stage_index=0):
            waiter = asyncio.create_task(adm.wait_until_drained(lambda: cached[0]))
            await asyncio.sleep(0.01)
            assert not waiter.done()  # a call is in flight
            cached[0] = 0  # its backward claimed the last cached microbatch
        assert await asyncio.wait_for(waiter, timeout=5) == 0

    asyncio.run(body())


def test_draining_gives_up_on_cached_microbatches_after_quiet_or_at_the_deadline():
    clock = Clock()

    async def body():
        quiet = admission(clock, drain_notice_s=0.0)
        quiet.begin_drain()
        clock.now += 5.0  # no call for drain_idle_s: their trainers are gone
        assert await quiet.wait_until_drained(lambda: 3) == 3

        late = admission(clock, drain_notice_s=0.0)
        late.begin_drain()
        clock.now += 29.0  # within a second of drain_timeout_s
        assert late.drain_left_s == 1.0
        async with late.call(new_work=False, stage_index=0):
            assert await late.wait_until_drained(lambda: 4) == 4

        with pytest.raises(RuntimeError, match="begin_drain"):
            await admission(clock).wait_until_drained(lambda: 0)

    asyncio.run(body())
