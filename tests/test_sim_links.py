"""Tests of the simulator's links (swarm.sim.links): transfer arithmetic, relays, sizes per codec, and a
swarm whose links, not its compute, set the pace."""

from __future__ import annotations

import random

import pytest

from swarm.sim import SimConfig, simulate
from swarm.sim.links import Link, LinkConfig, draw_peer_link, hop_bytes, message_bytes, transfer

pytestmark = pytest.mark.unit


def test_a_transfer_costs_size_over_bandwidth_plus_latency_on_both_ends():
    a, b = Link(8.0, 0.01), Link(80.0, 0.02)  # 1 MB/s and 10 MB/s
    arrive = transfer(0.0, 1e6, a, b)
    assert arrive == pytest.approx(1.0 + 0.01 + 0.1 + 0.02)
    # A second message from the same sender queues behind the first on its uplink.
    assert transfer(0.0, 1e6, a, b) == pytest.approx(2.0 + 0.01 + 0.1 + 0.02)


def test_a_relayed_peer_crosses_its_relays_link_too():
    relay = Link(8.0, 0.0)
    direct, nated = Link(800.0, 0.0), Link(800.0, 0.0, relay=relay)
    trainer = Link(800.0, 0.0)
    assert transfer(0.0, 1e6, trainer, direct) == pytest.approx(0.02)
    # 1 MB through a 1 MB/s relay: down into it and up out of it, one second each way.
    assert transfer(0.0, 1e6, Link(800.0, 0.0), nated) == pytest.approx(0.01 + 1.0 + 1.0 + 0.01)


def test_message_sizes_follow_the_codec():
    sizes = {
        codec: message_bytes(LinkConfig(codec=codec, values_per_sample=1024), 4)
        for codec in ("none", "fp16", "int8", "int4")
    }
    assert sizes == {
        "none": 4 * 1024 * 4.0,
        "fp16": 4 * 1024 * 2.0,
        "int8": 4 * 1024 * 34 / 32,
        "int4": 4 * 1024 * 18 / 32,
    }
    assert message_bytes(LinkConfig(tokens_per_sample=16), 4, tokens=True) == 8 * 16 * 4


def test_drawn_links_stay_in_their_ranges():
    config = LinkConfig(
        peer_mbit_s_min=10.0, peer_mbit_s_max=1000.0, relayed_share=0.5, num_relays=2
    )
    relays = [Link(100.0, 0.0), Link(100.0, 0.0)]
    links = [draw_peer_link(config, random.Random(i), relays) for i in range(400)]
    mbit = [link.bytes_per_s * 8 / 1e6 for link in links]
    assert min(mbit) >= 10.0 and max(mbit) <= 1000.0
    # Log-uniform: about half below the geometric middle (100 Mbit/s).
    assert 0.4 < sum(m < 100.0 for m in mbit) / len(mbit) < 0.6
    assert 0.4 < sum(link.relay is not None for link in links) / len(links) < 0.6


def test_link_config_says_what_is_wrong():
    with pytest.raises(ValueError, match=r"peer_mbit_s_max \(1.0\) must be >= peer_mbit_s_min"):
        LinkConfig(peer_mbit_s_min=2.0, peer_mbit_s_max=1.0)
    with pytest.raises(ValueError, match="codec must be one of none, fp16"):
        LinkConfig(codec="fp8")
    with pytest.raises(ValueError, match=r"relayed_share must be in \[0, 1\)"):
        LinkConfig(relayed_share=1.0)


def _one_peer(mbit_s: float, codec: str) -> SimConfig:
    """One stage, one fast peer (1000 samples/s: compute takes milliseconds), a link of ``mbit_s``."""
    return SimConfig(
        num_stages=1,
        num_peers=1,
        peer_speeds=(1000.0,),
        num_trainers=1,
        microbatches_in_flight=4,
        microbatch_size=8,
        duration_s=120.0,
        rebalance=False,
        links=LinkConfig(
            model_links=True,
            peer_mbit_s_min=mbit_s,
            peer_mbit_s_max=mbit_s,
            peer_latency_s_min=0.0,
            peer_latency_s_max=0.0,
            codec=codec,
            values_per_sample=4096,
            tokens_per_sample=4096,
        ),
    )


def test_a_slow_link_sets_the_pace_and_a_smaller_codec_lifts_it():
    # One stage: the request carries token ids (8 B x 4096 x 8 = 256 KiB) and the reply nothing, so the
    # peer's 8 Mbit/s downlink (1 MB/s) bounds the swarm near 1e6 / 262144 * 8 = 30.5 samples/s.
    result = simulate(_one_peer(8.0, "fp16"))
    bound = 1e6 / (8 * 4096 * 8) * 8
    rate = result.mean_throughput(start_s=20.0)
    assert 0.9 * bound < rate <= 1.01 * bound
    # Two stages: activations cross the cut, and int8 moves fewer bytes than fp16 through the same links.
    two = {
        codec: simulate(
            SimConfig(
                **{
                    **_one_peer(80.0, codec).__dict__,
                    "num_stages": 2,
                    "num_peers": 2,
                    "peer_speeds": (1000.0, 1000.0),
                    "links": LinkConfig(
                        model_links=True,
                        peer_mbit_s_min=80.0,
                        peer_mbit_s_max=80.0,
                        codec=codec,
                        values_per_sample=65536,
                        tokens_per_sample=16,
                    ),
                }
            )
        ).mean_throughput(start_s=20.0)
        for codec in ("fp16", "int8")
    }
    # int8 moves 1.9x fewer bytes; the latency of each hop and the queueing between hops are the same.
    assert two["int8"] > 1.3 * two["fp16"]


def test_links_off_by_default_leave_runs_as_they_were():
    config = SimConfig(num_peers=12, num_trainers=2, microbatches_in_flight=6, duration_s=60.0)
    assert simulate(config) == simulate(config)
    assert not config.links.model_links


def test_hop_bytes_per_direction():
    config = LinkConfig(values_per_sample=10, tokens_per_sample=3, codec="none")
    values, tokens = 40.0 * 2, 24.0 * 2  # 2 samples
    assert hop_bytes(config, 2, 0, 3, False, False) == (tokens, values)
    assert hop_bytes(config, 2, 1, 3, False, False) == (values, values)
    assert hop_bytes(config, 2, 2, 3, False, False) == (values, values)  # loss + input gradient
    assert hop_bytes(config, 2, 1, 3, True, False) == (values, values)
    assert hop_bytes(config, 2, 1, 3, True, True) == (2 * values, values)  # inputs travel too
    assert hop_bytes(config, 2, 0, 3, True, True) == (values + tokens, 0.0)
    assert hop_bytes(config, 2, 0, 1, False, False) == (tokens, 0.0)  # one stage: only the loss
