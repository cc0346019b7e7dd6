"""Unit tests of the routing policy (swarm.routing): pure, deterministic, no sleeps."""

from __future__ import annotations

import heapq
import random
from collections import Counter

import pytest
from conftest import STAGE, measured_router

from swarm.routing import (
    NoPeersAvailable,
    RetriesExhausted,
    Router,
    RoutingConfig,
    RoutingError,
)


def draw_shares(router: Router, draws: int, *, seed: int = 0, now: float = 1.0) -> dict[str, float]:
    rng = random.Random(seed)
    counts = Counter(router.choose(STAGE, now, rng) for _ in range(draws))
    return {peer: counts[peer] / draws for peer in router.peers(STAGE)}


# ---- choice -------------------------------------------------------------------------------


def test_work_share_is_proportional_to_measured_throughput():
    router = measured_router({"slow": 1.0, "fast": 4.0})
    shares = draw_shares(router, 20_000)
    # Expected 0.2 / 0.8; binomial sd over 20k draws is 0.003, so +-0.015 is 5 sd.
    assert shares["slow"] == pytest.approx(0.2, abs=0.015)
    assert shares["fast"] == pytest.approx(0.8, abs=0.015)


def test_in_flight_requests_shift_work_to_idle_peers():
    router = measured_router({"busy": 2.0, "idle": 2.0})
    for _ in range(3):
        router.on_start(STAGE, "busy", 0.5)
    # rate = 2 / (1 + 3) for busy vs 2 / (1 + 0) for idle: shares 0.2 / 0.8.
    shares = draw_shares(router, 20_000)
    assert shares["busy"] == pytest.approx(0.2, abs=0.015)
    # Finishing the requests restores the even split.
    router.on_success(STAGE, "busy", size=4.0, elapsed_s=2.0, now=1.0)
    router.on_failure(STAGE, "busy", now=1.0)
    router.on_cancel(STAGE, "busy", now=1.0)
    assert router.snapshot(STAGE, "busy", 1.0).in_flight == 0


def test_reported_compute_time_weighs_peers_by_what_they_serve_not_their_queue():
    # Two peers computing 8 samples in 1 s; "queued" answered once behind 5 s of other trainers' calls.
    router = Router(RoutingConfig(ema_alpha=0.5))
    router.update_peers(STAGE, {"queued": 1.0, "idle": 1.0}, now=0.0)
    for peer, elapsed_s in (("queued", 1.0), ("queued", 6.0), ("idle", 1.0), ("idle", 1.0)):
        router.on_start(STAGE, peer, 0.0)
        router.on_success(STAGE, peer, size=8.0, elapsed_s=elapsed_s, now=0.0, compute_s=1.0)
    # The round-trip EMA says 4.67 vs 8 samples/s; both serve 8 samples/s, so they split the work.
    assert router.snapshot(STAGE, "queued", 0.0).throughput_ema == pytest.approx(4 + 2 / 3)
    shares = draw_shares(router, 20_000)
    assert shares["queued"] == pytest.approx(0.5, abs=0.015)
    # Deadlines still follow the round trip: a call there takes longer.
    assert router.deadline_s(STAGE, "queued", 8.0) > router.deadline_s(STAGE, "idle", 8.0)


def test_a_peer_misreporting_its_compute_time_gains_no_more_than_its_fastest_round_trip():
    router = Router()
    router.update_peers(STAGE, {"liar": 1.0, "inflator": 1.0}, now=0.0)
    for elapsed_s in (2.0, 4.0, 4.0):  # 8 samples: 4, 2, 2 samples/s
        for peer, compute_s in (("liar", 1e-6), ("inflator", 100.0)):
            router.on_start(STAGE, peer, 0.0)
            router.on_success(
                STAGE, peer, size=8.0, elapsed_s=elapsed_s, now=0.0, compute_s=compute_s
            )
    # Claiming no compute: the rate of its fastest round trip (4 samples/s), no more.
    assert router.snapshot(STAGE, "liar", 0.0).throughput == pytest.approx(4.0, rel=1e-4)
    # Claiming more compute than the round trip took: capped at the round trip (the EMA of 2..4 samples/s).
    inflator = router.snapshot(STAGE, "inflator", 0.0)
    assert 2.0 <= inflator.throughput <= 4.0
    # A reply without a compute time (0, an older peer) leaves the round-trip EMA in charge.
    plain = measured_router({"p": 3.0})
    plain.on_start(STAGE, "p", 0.0)
    plain.on_success(STAGE, "p", size=8.0, elapsed_s=8.0 / 3.0, now=0.0, compute_s=None)
    assert plain.snapshot(STAGE, "p", 0.0).throughput == pytest.approx(3.0)


def test_first_measurement_replaces_prior_then_ema_blends():
    router = Router(RoutingConfig(ema_alpha=0.5))
    router.update_peers(STAGE, {"p": 100.0}, now=0.0)
    assert router.snapshot(STAGE, "p", 0.0).throughput == 100.0
    router.on_start(STAGE, "p", 0.0)
    router.on_success(STAGE, "p", size=10.0, elapsed_s=5.0, now=5.0)  # 2 samples/s
    state = router.snapshot(STAGE, "p", 5.0)
    assert (state.throughput_ema, state.latency_ema_s) == (2.0, 5.0)
    router.on_start(STAGE, "p", 5.0)
    router.on_success(STAGE, "p", size=10.0, elapsed_s=2.5, now=7.5)  # 4 samples/s
    state = router.snapshot(STAGE, "p", 7.5)
    assert (state.throughput_ema, state.latency_ema_s) == (3.0, 3.75)
    assert state.num_successes == 2


def test_new_peer_without_claim_competes_with_the_best_known_peer():
    router = measured_router({"old": 4.0}, explore_probability=0.0)
    router.update_peers(STAGE, {"old": 4.0, "new": 0.0}, now=1.0)  # 0 = no usable claim
    assert router.snapshot(STAGE, "new", 1.0).throughput == 4.0
    rng = random.Random(1)
    first = next(i for i in range(100) if router.choose(STAGE, 1.0, rng) == "new")
    assert first < 10
    # Once measured fast, it takes the larger share.
    router.on_start(STAGE, "new", 1.0)
    router.on_success(STAGE, "new", size=8.0, elapsed_s=0.5, now=1.5)  # 16 samples/s
    assert draw_shares(router, 5_000, now=2.0)["new"] == pytest.approx(0.8, abs=0.03)


def test_under_announcing_peer_is_explored_soon():
    router = measured_router({"old": 4.0}, explore_probability=0.1)
    router.update_peers(STAGE, {"old": 4.0, "shy": 1e-6}, now=1.0)
    rng = random.Random(2)
    # The weighted draw alone would pick "shy" once in ~4 million; exploration does it in ~10.
    first = next(i for i in range(1_000) if router.choose(STAGE, 1.0, rng) == "shy")
    assert first < 100
    # While its probe is in flight it is not explored again (one probe at a time).
    router.on_start(STAGE, "shy", 1.0)
    assert "shy" not in {router.choose(STAGE, 1.0, rng) for _ in range(1_000)}


def test_false_high_claim_does_not_outbid_measured_peers():
    router = measured_router({"honest": 4.0}, explore_probability=0.0)
    router.update_peers(STAGE, {"honest": 4.0, "liar": 1e9}, now=1.0)
    assert router.snapshot(STAGE, "liar", 1.0).throughput == 4.0
    assert draw_shares(router, 10_000)["liar"] == pytest.approx(0.5, abs=0.02)


def test_announcements_order_peers_before_any_measurement():
    router = Router(RoutingConfig(explore_probability=0.0))
    router.update_peers(STAGE, {"a": 1.0, "b": 3.0, "bad": float("nan")}, now=0.0)
    states = {s.peer_id: s.throughput for s in router.snapshots(STAGE, 0.0)}
    assert states == {"a": 1.0, "b": 3.0, "bad": 3.0}  # NaN is "no claim" -> best known


def test_choice_is_reproducible_with_the_same_seed():
    router = measured_router({"a": 1.0, "b": 2.0, "c": 3.0})
    rng1, rng2 = random.Random(9), random.Random(9)
    seq1 = [router.choose(STAGE, 1.0, rng1) for _ in range(200)]
    seq2 = [router.choose(STAGE, 1.0, rng2) for _ in range(200)]
    assert seq1 == seq2 and set(seq1) == {"a", "b", "c"}


def test_exclude_skips_peers_that_failed_this_request():
    router = measured_router({"a": 1.0, "b": 100.0})
    rng = random.Random(3)
    assert {router.choose(STAGE, 1.0, rng, exclude={"b"}) for _ in range(200)} == {"a"}


# ---- bans ---------------------------------------------------------------------------------


def test_bans_grow_exponentially_cap_and_expire():
    router = measured_router({"flaky": 1.0, "ok": 1.0}, ban_base_s=1.0, ban_max_s=8.0)
    rng = random.Random(4)
    now = 10.0
    for expected_ban_s in (1.0, 2.0, 4.0, 8.0, 8.0):
        router.on_start(STAGE, "flaky", now)
        until = router.on_failure(STAGE, "flaky", now)
        assert until == now + expected_ban_s
        just_before = until - 1e-6
        assert router.banned_until_s("flaky", just_before) == until
        assert {router.choose(STAGE, just_before, rng) for _ in range(100)} == {"ok"}
        now = until  # the ban has ended at exactly `until`
        assert router.banned_until_s("flaky", now) is None
        assert "flaky" in {router.choose(STAGE, now, rng) for _ in range(100)}
    assert router.snapshot(STAGE, "flaky", now).failures == 5
    # A success resets the count: the next failure bans for ban_base_s again.
    router.on_start(STAGE, "flaky", now)
    router.on_success(STAGE, "flaky", size=1.0, elapsed_s=1.0, now=now + 1)
    assert router.snapshot(STAGE, "flaky", now + 1).failures == 0
    assert router.on_failure(STAGE, "flaky", now + 1) == now + 2


def test_requests_failing_together_count_as_one_incident():
    router = measured_router({"p": 1.0, "q": 1.0}, ban_base_s=2.0)
    for _ in range(8):
        router.on_start(STAGE, "p", 0.0)
    # The peer crashes with 8 requests in flight; their failures trickle in during the ban.
    bans = [router.on_failure(STAGE, "p", now=0.1 * i) for i in range(8)]
    assert bans == [2.0] * 8
    assert router.snapshot(STAGE, "p", 1.0).failures == 1
    assert router.snapshot(STAGE, "p", 1.0).in_flight == 0
    # The next failure after the ban is the second incident: twice as long.
    assert router.on_failure(STAGE, "p", now=2.0) == 6.0


def test_success_of_an_older_request_does_not_lift_a_running_ban():
    router = measured_router({"p": 1.0, "q": 1.0}, ban_base_s=5.0)
    router.on_start(STAGE, "p", 0.0)  # slow request, still running
    router.on_start(STAGE, "p", 1.0)
    until = router.on_failure(STAGE, "p", 1.0)
    router.on_success(STAGE, "p", size=1.0, elapsed_s=2.0, now=2.0)
    assert router.banned_until_s("p", 2.0) == until == 6.0


def test_reannouncement_does_not_lift_a_ban():
    router = measured_router({"p": 1.0}, ban_base_s=30.0)
    router.on_start(STAGE, "p", 0.0)
    until = router.on_failure(STAGE, "p", 0.0)
    router.update_peers(STAGE, {}, now=1.0)  # p left discovery...
    router.update_peers(STAGE, {"p": 50.0}, now=2.0)  # ...and came back at once
    with pytest.raises(NoPeersAvailable) as info:
        router.choose(STAGE, 2.0, random.Random(0))
    assert info.value.retry_at_s == until == 30.0
    assert router.choose(STAGE, until, random.Random(0)) == "p"


def test_peers_that_left_lose_their_stats_but_stayers_keep_them():
    router = measured_router({"stay": 2.0, "leave": 3.0})
    router.on_start(STAGE, "stay", 0.0)
    router.update_peers(STAGE, {"stay": 9.0, "join": 1.0}, now=1.0)
    assert router.peers(STAGE) == ("stay", "join")
    stay = router.snapshot(STAGE, "stay", 1.0)
    assert (stay.throughput_ema, stay.in_flight) == (2.0, 1)
    with pytest.raises(KeyError, match="leave"):
        router.snapshot(STAGE, "leave", 1.0)
    # Lifecycle calls about a departed peer still reach its ban record and do not crash.
    router.on_success(STAGE, "leave", size=1.0, elapsed_s=1.0, now=1.0)
    assert router.on_failure(STAGE, "leave", now=1.0) == 2.0
    assert router.banned_until_s("leave", 1.5) == 2.0


def test_ban_records_are_bounded_and_keep_the_latest_ban():
    router = Router(RoutingConfig(max_ban_records=2, ban_base_s=10.0))
    router.update_peers(STAGE, {"a": 1.0, "b": 1.0, "c": 1.0}, now=0.0)
    router.on_failure(STAGE, "a", now=0.0)  # banned until 10
    router.on_failure(STAGE, "b", now=5.0)  # banned until 15
    router.on_failure(STAGE, "c", now=1.0)  # banned until 11 -> forget "a" (ends first)
    assert router.banned_until_s("a", 6.0) is None
    assert router.banned_until_s("b", 6.0) == 15.0
    assert router.banned_until_s("c", 6.0) == 11.0


# ---- errors when nobody can serve ---------------------------------------------------------


def test_no_peers_announced_names_the_stage_and_what_to_do():
    router = Router()
    with pytest.raises(NoPeersAvailable, match=r"stage 3: none is announced.*swarm peer --stage 3"):
        router.choose(STAGE, 0.0, random.Random(0))


def test_all_banned_says_until_when():
    router = measured_router({"a": 1.0, "b": 1.0}, ban_base_s=2.0)
    router.on_failure(STAGE, "a", now=1.0)
    router.on_failure(STAGE, "b", now=0.5)
    with pytest.raises(NoPeersAvailable, match=r"all 2 peer\(s\) of stage 3 are banned.*t=2\.500s"):
        router.choose(STAGE, 1.0, random.Random(0))


def test_all_excluded_and_mixed_reasons():
    router = measured_router({"a": 1.0, "b": 1.0})
    with pytest.raises(NoPeersAvailable, match=r"all 2 peer\(s\) of stage 3 were excluded") as info:
        router.choose(STAGE, 1.0, random.Random(0), exclude={"a", "b"})
    assert (info.value.num_known, info.value.num_excluded, info.value.stage) == (2, 2, STAGE)
    router.on_failure(STAGE, "a", now=1.0)
    with pytest.raises(NoPeersAvailable, match=r"stage 3: of 2 announced, 1 are banned") as info:
        router.choose(STAGE, 1.0, random.Random(0), exclude={"b"})
    assert (info.value.num_banned, info.value.retry_at_s) == (1, 2.0)


def test_error_hierarchy():
    assert issubclass(RoutingError, RuntimeError)
    assert issubclass(NoPeersAvailable, RoutingError)
    assert issubclass(RetriesExhausted, RoutingError)


# ---- deadlines ----------------------------------------------------------------------------


def test_deadlines_follow_measured_latency_within_bounds():
    config = dict(
        min_timeout_s=0.5,
        max_timeout_s=30.0,
        initial_timeout_s=20.0,
        timeout_factor=3.0,
        timeout_slack_s=0.25,
    )
    router = measured_router({"fast": 8.0, "slow": 2.0}, **config)
    router.update_peers(STAGE, {"fast": 1.0, "slow": 1.0, "new": 1.0}, now=1.0)
    assert router.deadline_s(STAGE, "new", 8.0) == 20.0  # unmeasured
    assert router.deadline_s(STAGE, "gone", 8.0) == 20.0  # unknown
    # 3 * 8 samples / 8 samples/s + 0.25 = 3.25 s; the slower peer gets 4x the compute time.
    assert router.deadline_s(STAGE, "fast", 8.0) == pytest.approx(3.25)
    assert router.deadline_s(STAGE, "slow", 8.0) == pytest.approx(12.25)
    assert router.deadline_s(STAGE, "slow", 16.0) == pytest.approx(24.25)  # scales with size
    assert router.deadline_s(STAGE, "fast", 0.01) == 0.5  # clamped up
    assert router.deadline_s(STAGE, "slow", 1000.0) == 30.0  # clamped down
    # Slower answers raise the deadline through the EMA.
    before = router.deadline_s(STAGE, "fast", 8.0)
    router.on_success(STAGE, "fast", size=8.0, elapsed_s=4.0, now=2.0)
    assert router.deadline_s(STAGE, "fast", 8.0) > before


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(size=0.0, elapsed_s=1.0),
        dict(size=1.0, elapsed_s=0.0),
        dict(size=1.0, elapsed_s=float("inf")),
    ],
)
def test_on_success_rejects_impossible_measurements(kwargs):
    router = measured_router({"p": 1.0})
    with pytest.raises(ValueError, match="must be"):
        router.on_success(STAGE, "p", now=1.0, **kwargs)


# ---- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(ema_alpha=0.0), r"ema_alpha must be in \(0, 1\], got 0.0"),
        (dict(ema_alpha=1.5), r"ema_alpha must be in \(0, 1\], got 1.5"),
        (dict(min_timeout_s=0.0), r"min_timeout_s must be > 0 seconds, got 0.0"),
        (
            dict(min_timeout_s=5.0, max_timeout_s=2.0, initial_timeout_s=3.0),
            r"max_timeout_s \(2.0\) must be >= min_timeout_s \(5.0\)",
        ),
        (
            dict(initial_timeout_s=500.0),
            r"initial_timeout_s \(500.0\) must lie in .* \[1.0, 120.0\]",
        ),
        (dict(timeout_factor=0.5), r"timeout_factor must be >= 1 .* got 0.5"),
        (dict(timeout_slack_s=-1.0), r"timeout_slack_s must be >= 0 seconds, got -1.0"),
        (dict(ban_base_s=0.0), r"ban_base_s must be > 0 seconds, got 0.0"),
        (dict(ban_base_s=10.0, ban_max_s=5.0), r"ban_max_s \(5.0\) must be >= ban_base_s \(10.0\)"),
        (dict(max_attempts=0), r"max_attempts must be >= 1, got 0"),
        (dict(max_attempts=2.5), r"max_attempts must be an int, got 2.5"),
        (dict(explore_probability=1.2), r"explore_probability must be in \[0, 1\], got 1.2"),
        (dict(max_ban_records=0), r"max_ban_records must be >= 1, got 0"),
        (dict(default_throughput=-1.0), r"default_throughput must be > 0 samples/s, got -1.0"),
        (dict(ban_max_s=float("nan")), r"ban_max_s must be a finite number, got nan"),
    ],
)
def test_config_validation_states_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**kwargs)


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        RoutingConfig(0.3)  # type: ignore[misc]


# ---- a small simulated swarm --------------------------------------------------------------


def simulate_closed_loop(
    speeds: dict[str, float],
    *,
    in_flight: int,
    duration_s: float,
    seed: int,
    joins: dict[str, tuple[float, float]] | None = None,
    explore_probability: float = 0.0,
) -> tuple[list[tuple[float, str]], Router]:
    """A trainer keeps ``in_flight`` requests of 1 sample each in flight against peers of STAGE.

    Each peer serves one request at a time, FIFO, at ``speeds[peer]`` samples/s, so the observed
    round trip includes queueing. Peers in ``joins`` ({peer: (join_at_s, announced)}) are
    announced only from ``join_at_s``; the others from the start with an equal announcement of
    1.0, so the router must learn who is fast from round trips alone. Time is simulated (an
    event heap), not slept. Returns the (completion time, peer) of every served sample.
    """
    joins = joins or {}
    router = Router(RoutingConfig(explore_probability=explore_probability))
    announced = {peer: 1.0 for peer in speeds if peer not in joins}
    router.update_peers(STAGE, announced, now=0.0)
    pending_joins = sorted((at, peer, claim) for peer, (at, claim) in joins.items())
    rng = random.Random(seed)
    free_at = {peer: 0.0 for peer in speeds}
    served: list[tuple[float, str]] = []
    events: list[tuple[float, int, str, float]] = []  # (done_at_s, seq, peer, sent_at_s)

    def send(now: float, seq: int) -> None:
        peer = router.choose(STAGE, now, rng)
        router.on_start(STAGE, peer, now)
        free_at[peer] = max(now, free_at[peer]) + 1.0 / speeds[peer]
        heapq.heappush(events, (free_at[peer], seq, peer, now))

    for seq in range(in_flight):
        send(0.0, seq)
    seq = in_flight
    while events[0][0] <= duration_s:
        done_at, _, peer, sent_at = heapq.heappop(events)
        while pending_joins and pending_joins[0][0] <= done_at:
            _, new_peer, claim = pending_joins.pop(0)
            announced[new_peer] = claim
            router.update_peers(STAGE, announced, now=done_at)
        router.on_success(STAGE, peer, size=1.0, elapsed_s=done_at - sent_at, now=done_at)
        served.append((done_at, peer))
        send(done_at, seq)
        seq += 1
    return served, router


def share(served: list[tuple[float, str]], peer: str, start_s: float, end_s: float) -> float:
    window = [p for t, p in served if start_s <= t < end_s]
    return window.count(peer) / len(window)


def test_simulated_slow_peer_gets_a_fifth_of_the_work():
    served, router = simulate_closed_loop(
        {"fast": 4.0, "slow": 1.0}, in_flight=4, duration_s=400.0, seed=11
    )
    assert share(served, "slow", 0.0, 400.0) == pytest.approx(0.2, abs=0.02)
    # Neither peer sits idle: the swarm delivers close to its 5 samples/s capacity.
    assert len(served) / 400.0 > 0.95 * 5.0
    ema = {s.peer_id: s.throughput_ema for s in router.snapshots(STAGE, 400.0)}
    assert ema["fast"] > 2.0 * ema["slow"]


def test_simulated_fast_newcomer_is_found_and_takes_most_work():
    # "fast" joins at t=50 s announcing 1e-3 samples/s (a stale benchmark): only exploration
    # (5% of choices go to idle unmeasured peers) makes it likely to be tried within seconds.
    served, _ = simulate_closed_loop(
        {"slow": 1.0, "fast": 4.0},
        in_flight=4,
        duration_s=200.0,
        seed=12,
        joins={"fast": (50.0, 1e-3)},
        explore_probability=0.05,
    )
    first_fast = min(t for t, p in served if p == "fast")
    assert 50.0 < first_fast < 80.0
    assert share(served, "fast", 100.0, 200.0) == pytest.approx(0.8, abs=0.03)
