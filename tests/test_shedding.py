"""Load shedding: the pure rule, the peer's queue in seconds, and what a trainer does with a refusal."""

import random

import grpc
import pytest

from swarm.errors import DeadlineUnmet, PeerOverloaded, error_from_status, wire_name
from swarm.peer.config import LimitsConfig
from swarm.peer.queue import WorkQueue
from swarm.routing import NoPeersAvailable, Router, StageRequest, wake_at
from swarm.routing.retry import Failure, failure_kind
from swarm.routing.shedding import ShedReason, shed_reason


def test_rule_checks_expiry_then_queue_bound_then_the_deadline():
    def reason(**kw):
        args = dict(now_s=10.0, deadline_s=15.0, queue_wait_s=1.0, cost_s=1.0, max_queue_wait_s=3.0)
        return shed_reason(**{**args, **kw})

    assert reason() is None
    assert reason(deadline_s=None, queue_wait_s=2.9) is None  # no deadline: only the bound applies
    assert reason(deadline_s=10.0) is ShedReason.EXPIRED
    assert reason(deadline_s=9.0, queue_wait_s=99.0) is ShedReason.EXPIRED  # the first reason wins
    assert reason(queue_wait_s=3.5, deadline_s=100.0) is ShedReason.QUEUE_FULL
    assert reason(queue_wait_s=3.5, max_queue_wait_s=0.0, deadline_s=100.0) is None  # 0 = unbounded
    assert reason(queue_wait_s=2.0, cost_s=3.0) is None  # ends at 15.0: just in time
    assert reason(queue_wait_s=2.0, cost_s=3.01) is ShedReason.UNMEETABLE
    # Nothing measured yet (cost 0) and an empty queue: only an expired deadline sheds.
    assert reason(queue_wait_s=0.0, cost_s=0.0, deadline_s=10.001) is None
    with pytest.raises(ValueError, match="cost_s must be finite and >= 0"):
        reason(cost_s=-1.0)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_queue_counts_admitted_work_and_sheds_what_it_cannot_finish_in_time():
    clock = Clock()
    queue = WorkQueue(max_queue_wait_s=10.0, clock=clock)
    with queue.admit(deadline_s=106.0, cost_s=2.0):
        with queue.admit(deadline_s=106.0, cost_s=2.0):
            assert queue.queued_s == 4.0
            # 4 s queued + 2 s of its own: done at 106, in time; 2.5 s would end after the deadline.
            with queue.admit(deadline_s=106.0, cost_s=2.0):
                pass
            with pytest.raises(DeadlineUnmet, match="end after the caller's deadline"):
                with queue.admit(deadline_s=106.0, cost_s=2.5):
                    pass
        assert queue.queued_s == 2.0
    assert queue.queued_s == 0.0
    assert queue.shed[ShedReason.UNMEETABLE] == 1 and queue.shed_total == 1


def test_work_whose_deadline_passed_while_queued_is_not_started():
    clock = Clock()
    queue = WorkQueue(max_queue_wait_s=0.0, clock=clock)
    ran = []
    with pytest.raises(DeadlineUnmet, match="deadline passed .* before this call's turn"):
        with queue.admit(deadline_s=101.0, cost_s=0.5) as guard:
            work = guard(ran.append)
            clock.now = 101.5  # the calls ahead took longer than predicted
            work("computed")
    assert ran == [] and queue.shed[ShedReason.EXPIRED] == 1 and queue.queued_s == 0.0
    with queue.admit(deadline_s=None, cost_s=0.5) as guard:
        guard(ran.append)("no deadline: always runs")
    assert ran == ["no deadline: always runs"]


def test_a_correction_raised_by_a_stall_relaxes_while_nothing_is_measured():
    """A replica frozen mid-job measures its jobs up to the correction's cap; every prediction then ends past its
    callers' deadlines, it admits nothing and would measure nothing that lowers it (the soak's thawed replica
    refused 895 calls in 10 minutes). Without measurements the correction relaxes toward 1, and the jobs it then
    admits measure it afresh."""
    clock = Clock()
    queue = WorkQueue(max_queue_wait_s=0.0, clock=clock)

    def stretched(seconds):
        def job():
            clock.now += seconds

        return job

    for _ in range(10):  # jobs predicted at 0.5 s, each stretched to 5 s by a freeze
        with queue.admit(deadline_s=None, cost_s=0.5) as guard:
            guard(stretched(5.0))()
    assert queue.correction > 9.0
    with pytest.raises(DeadlineUnmet, match="end after the caller's deadline"):
        with queue.admit(deadline_s=clock.now + 2.0, cost_s=0.5):
            pass
    clock.now += 20.0  # four half-lives without a measured job
    assert 1.0 < queue.correction < 1.6
    with queue.admit(deadline_s=clock.now + 2.0, cost_s=0.5) as guard:
        guard(stretched(0.5))()  # as predicted: the correction falls further
    assert queue.correction < 1.45
    # a peer that really is slow measures it again at once
    with queue.admit(deadline_s=None, cost_s=0.5) as guard:
        guard(stretched(2.0))()
    assert queue.correction > 1.9


def test_opting_out_admits_everything():
    clock = Clock()
    queue = WorkQueue(max_queue_wait_s=1.0, enabled=False, clock=clock)
    ran = []
    with queue.admit(deadline_s=50.0, cost_s=5.0) as guard:
        guard(ran.append)("late work")
    assert ran == ["late work"] and queue.shed_total == 0


def test_limits_config_checks_the_queue_bound():
    assert LimitsConfig().max_queue_wait_s > 0 and LimitsConfig().shed_late_work
    with pytest.raises(ValueError, match="max_queue_wait_s must be >= 0"):
        LimitsConfig(max_queue_wait_s=-1.0)


def test_refusal_crosses_the_wire_typed_and_is_retried_elsewhere_without_a_ban():
    error = DeadlineUnmet("busy")
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and wire_name(error) == "DeadlineUnmet"
    rebuilt = error_from_status(error.code, "busy", name="DeadlineUnmet")
    assert type(rebuilt) is DeadlineUnmet
    # An older caller that knows no such name still retries elsewhere (as for any overloaded peer).
    assert type(error_from_status(error.code, "busy")) is PeerOverloaded

    router = Router()
    router.update_peers(0, {"a": 1.0, "b": 1.0}, now=0.0)
    request = StageRequest(router, 0)
    router.on_start(0, "a", 0.0)
    assert failure_kind(rebuilt) is Failure.SHED
    assert request.failed("a", rebuilt, 0.0) is Failure.SHED
    # Not a fault: no failure counted, no ban.
    snapshot = router.snapshot(0, "a", 0.0)
    assert snapshot.failures == 0 and snapshot.in_flight == 0 and snapshot.banned_until_s is None
    assert request.choose(0.0, random.Random(0)) == "b"  # this request goes to the other peer


def test_when_every_peer_shed_a_request_it_waits_before_trying_one_again():
    router = Router()
    router.update_peers(0, {"a": 1.0}, now=0.0)
    request = StageRequest(router, 0)
    router.on_start(0, "a", 0.0)
    request.failed("a", DeadlineUnmet("busy"), 0.0)
    with pytest.raises(NoPeersAvailable) as info:
        request.choose(0.5, random.Random(0))
    assert info.value.retry_at_s == router.config.shed_hold_s == 1.0
    assert wake_at(info.value, 0.5, wait_s=5.0) == 1.0
    assert request.choose(1.0, random.Random(0)) == "a"  # then tried again, one attempt spent
    assert request.budget.attempts_left == router.config.max_attempts - 1
    # Other requests are not held back: the peer itself is neither banned nor penalised.
    assert StageRequest(router, 0).choose(0.5, random.Random(0)) == "a"


def test_a_call_past_its_own_deadline_reads_as_a_late_reply_and_a_peer_cut_stream_keeps_its_name():
    late = error_from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", peer="p:1")
    assert str(late) == "peer p:1: no reply within the call's deadline (Deadline Exceeded)"
    assert late.status == grpc.StatusCode.DEADLINE_EXCEEDED
    cut = error_from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "idle 2s", name="StreamTimeout")
    assert type(cut).__name__ == "StreamTimeout" and str(cut) == "idle 2s"
