"""Routing in large stages: a bounded sample of candidates per choice, still weighted by rate."""

import random
from collections import Counter

import pytest

from swarm.routing import NoPeersAvailable, Router, RoutingConfig


def measured(rates: dict[str, float], **config) -> Router:
    router = Router(RoutingConfig(**config))
    router.update_peers(0, {peer: 1.0 for peer in rates}, now=0.0)
    for peer, rate in rates.items():
        router.on_start(0, peer, 0.0)
        router.on_success(0, peer, size=8.0, elapsed_s=8.0 / rate, now=0.0)
    return router


def test_a_large_stage_is_sampled_and_choices_stay_proportional_to_rate():
    rates = {f"slow{i}": 1.0 for i in range(500)} | {f"fast{i}": 3.0 for i in range(500)}
    router = measured(rates, max_candidates=32, explore_probability=0.0)
    rng = random.Random(0)
    picks = Counter(router.choose(0, 1.0, rng)[:4] for _ in range(20_000))
    # Proportional to rate: 3 to 1 (a sample of 32 gives about that, within a few percent).
    assert 2.7 < picks["fast"] / picks["slow"] < 3.3, picks
    spread = Counter(router.choose(0, 1.0, rng) for _ in range(20_000))
    assert len(spread) > 900  # nearly every peer is chosen at some point: no peer is starved


def test_when_the_sample_holds_no_eligible_peer_every_peer_is_considered():
    rates = {f"p{i}": 1.0 for i in range(100)}
    router = measured(rates, max_candidates=4, ban_base_s=100.0)
    for peer in list(rates)[:99]:
        router.on_start(0, peer, 0.0)
        router.on_failure(0, peer, 0.0)  # banned until t=100
    rng = random.Random(1)
    assert {router.choose(0, 1.0, rng) for _ in range(50)} == {"p99"}
    with pytest.raises(NoPeersAvailable):
        router.choose(0, 1.0, rng, exclude={"p99"})


def test_max_candidates_is_checked():
    with pytest.raises(ValueError, match="max_candidates must be >= 0"):
        RoutingConfig(max_candidates=-1)
    # 0 weighs every peer (the exact rule for any stage size).
    router = measured({f"p{i}": 1.0 for i in range(64)}, max_candidates=0)
    assert router.choose(0, 1.0, random.Random(0)).startswith("p")
