"""The retry rule of one stage request (swarm.routing.retry, swarm.routing.budget), shared by the trainer and
the simulator: pure, deterministic, no sleeps."""

from __future__ import annotations

import random

import pytest
from conftest import STAGE, measured_router

from swarm.errors import (
    AlreadyApplied,
    InvalidRequest,
    NotCached,
    PeerDraining,
    PeerOverloaded,
    TransportError,
    WrongPeer,
)
from swarm.routing import (
    Failure,
    NoPeersAvailable,
    RetriesExhausted,
    RetryBudget,
    RoutingConfig,
    StageRequest,
    wake_at,
)
from swarm.routing.retry import failure_kind

# ---- retry budget -------------------------------------------------------------------------


def test_retry_budget_is_finite_and_names_the_stage():
    router = measured_router({"a": 1.0, "b": 1.0, "c": 1.0}, max_attempts=3)
    budget = router.retry_budget(STAGE)
    assert budget.attempts_left == 3
    rng = random.Random(5)
    errors = [ConnectionError(f"boom {i}") for i in range(3)]
    with pytest.raises(RetriesExhausted, match=r"stage 3 request failed after 3 attempt") as info:
        for error in errors:
            peer = router.choose(STAGE, 1.0, rng, exclude=budget.failed_peers)
            assert peer not in budget.failed_peers
            router.on_start(STAGE, peer, 1.0)
            router.on_failure(STAGE, peer, 1.0)
            budget.record_failure(peer, error)
    assert budget.failed_peers == {"a", "b", "c"}
    assert (info.value.stage, info.value.attempts) == (STAGE, 3)
    assert info.value.last_error is errors[-1] and info.value.__cause__ is errors[-1]
    assert "boom 2" in str(info.value)


def test_default_retry_budget_is_finite():
    assert 1 <= RoutingConfig().max_attempts < 100
    with pytest.raises(ValueError, match="max_attempts must be >= 1, got 0"):
        RetryBudget(0, max_attempts=0)


# ---- the retry rule shared by the trainer and the simulator -------------------------------


def test_backward_prefers_the_forward_peer_while_it_may_be_tried():
    router = measured_router({"fwd": 1.0, "other": 100.0})
    rng = random.Random(0)
    request = StageRequest(router, STAGE, preferred="fwd")
    assert [request.choose(1.0, rng) for _ in range(20)] == [
        "fwd"
    ] * 20  # despite a 100x faster peer
    # The caller no longer lists it (gone from discovery): routing chooses.
    assert request.choose(1.0, rng, preferred_known=False) == "other"
    # Banned by another request's failure: not preferred until the ban ends.
    router.on_failure(STAGE, "fwd", now=1.0)
    assert request.choose(1.5, rng) == "other"
    assert request.choose(10.0, rng) == "fwd"
    # Failed this request: never preferred again in it, even after its ban ends.
    router.on_start(STAGE, "fwd", 10.0)
    request.failed("fwd", TransportError("reset"), now=10.0)
    assert {request.choose(100.0, rng) for _ in range(20)} == {"other"}


def test_once_every_peer_failed_the_request_they_are_retried_within_the_same_budget():
    router = measured_router({"a": 1.0, "b": 1.0}, max_attempts=4, ban_base_s=1.0)
    rng = random.Random(1)
    request = StageRequest(router, STAGE)
    now, tried = 1.0, []
    with pytest.raises(RetriesExhausted, match="failed after 4 attempt") as info:
        for _ in range(5):
            try:
                peer = request.choose(now, rng)
            except NoPeersAvailable as e:  # both banned: wait for the first ban to end
                assert e.num_banned == 2
                now = wake_at(e, now, wait_s=60.0)
                peer = request.choose(now, rng)
            tried.append(peer)
            router.on_start(STAGE, peer, now)
            assert request.failed(peer, PeerOverloaded("full"), now) is Failure.BAN
    # Both peers tried, then tried again without exclusions; the budget was never reset (4 attempts, not more).
    assert sorted(tried[:2]) == ["a", "b"] and len(tried) == 4 and info.value.attempts == 4
    assert isinstance(info.value.last_error, PeerOverloaded)


def test_what_a_failure_does_depends_on_its_kind():
    router = measured_router({"p": 1.0, "q": 1.0}, max_attempts=10)
    request = StageRequest(router, STAGE)
    # Invalid anywhere: give up; no ban, nothing counted, the in-flight call ended.
    router.on_start(STAGE, "p", 1.0)
    assert request.failed("p", InvalidRequest("bad shape"), 1.0) is Failure.GIVE_UP
    assert router.banned_until_s("p", 1.0) is None and request.budget.attempts_failed == 0
    assert router.snapshot(STAGE, "p", 1.0).in_flight == 0
    # Draining or moved: no ban, but counted and excluded from this request.
    for error in (PeerDraining("leaving"), WrongPeer("serves stage 2")):
        router.on_start(STAGE, "p", 1.0)
        assert request.failed("p", error, 1.0) is Failure.AVOID
        assert router.banned_until_s("p", 1.0) is None
    assert request.budget.attempts_failed == 2 and request.failed_peers == {"p"}
    # Anything else, or no error object (the simulator's dead peer): ban with back-off.
    for error in (TransportError("reset"), PeerOverloaded("full"), NotCached("evicted?"), None):
        assert request.failed("q", error, 1.0) is Failure.BAN
    assert failure_kind(AlreadyApplied("once")) is Failure.GIVE_UP
    assert router.banned_until_s("q", 1.0) is not None and request.budget.attempts_failed == 6


def test_wake_at_the_first_ban_end_or_after_the_wait():
    banned = NoPeersAvailable(STAGE, num_known=2, num_banned=2, retry_at_s=12.0)
    assert wake_at(banned, 10.0, wait_s=5.0) == 12.0
    assert wake_at(banned, 10.0, wait_s=1.0) == 11.0  # peers may appear meanwhile
    # never a busy loop
    assert wake_at(banned, 12.0, wait_s=5.0, min_wait_s=0.05) == pytest.approx(12.05)
    empty = NoPeersAvailable(STAGE, num_known=0)
    assert wake_at(empty, 10.0, wait_s=5.0) == 15.0
