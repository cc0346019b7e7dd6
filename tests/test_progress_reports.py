"""How often a replica that averages directly writes its progress record (swarm.averaging.hivemind_private's
ThrottledEvent, which wakes hivemind's reporting thread): at once when it has not written for the interval, else
once at the interval's end for any number of reports meanwhile; at once again on shutdown."""

from __future__ import annotations

from swarm.averaging.hivemind_private import ThrottledEvent


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
