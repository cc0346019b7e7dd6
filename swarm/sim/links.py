"""Network links of a simulated swarm: per-peer bandwidth and latency, message sizes per codec, relays.

A message of ``b`` bytes from A to B leaves through A's uplink and enters through B's downlink; each
link carries one message at a time (FIFO, like a peer's compute queue), so a transfer costs
``b / bandwidth_A + latency_A`` on A's side and ``b / bandwidth_B + latency_B`` on B's side, after
whatever that link still had to carry. A relayed peer (behind NAT) reaches everyone through its relay:
its messages also cross the relay's link in both directions (store and forward).

Link speeds are drawn per peer, log-uniform between ``min`` and ``max`` (home links to data centres
span orders of magnitude); latency uniform. Sizes come from the model's boundary (values per sample
crossing a cut) and the run's codec's wire bytes per value
(:data:`swarm.compression.names.BYTES_PER_VALUE`). Trainers have links of their own.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from swarm.compression.names import BYTES_PER_VALUE, CODEC_NAMES

__all__ = ["Link", "LinkConfig", "draw_peer_link", "hop_bytes", "message_bytes", "transfer"]


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """How links are drawn and how large messages are; ``model_links=False`` keeps the flat one-way delay."""

    FLAG_TITLE = "simulated links"

    # Model links at all (False: every message takes SimConfig.latency_s, whatever its size).
    model_links: bool = False
    # A peer's link bandwidth (each direction), Mbit/s, log-uniform in [min, max].
    peer_mbit_s_min: float = 20.0
    peer_mbit_s_max: float = 1000.0
    # A peer's one-way link latency, seconds, uniform in [min, max].
    peer_latency_s_min: float = 0.005
    peer_latency_s_max: float = 0.05
    # Each trainer's link, Mbit/s and seconds one way.
    trainer_mbit_s: float = 10_000.0
    trainer_latency_s: float = 0.001
    # Share of peers behind NAT, reached through a relay, in [0, 1).
    relayed_share: float = 0.0
    # Relay nodes (shared by the relayed peers, assigned at random) and their links.
    num_relays: int = 4
    relay_mbit_s: float = 1000.0
    relay_latency_s: float = 0.01
    # Float values per sample crossing a stage boundary (sequence length x boundary width).
    values_per_sample: int = 128 * 256
    # Token ids per sample entering stage 0 (8 bytes each).
    tokens_per_sample: int = 128
    # Wire codec of activations and gradients (a name of swarm.compression).
    codec: str = "fp16"

    def __post_init__(self) -> None:
        for name in (
            "peer_mbit_s_min",
            "peer_mbit_s_max",
            "trainer_mbit_s",
            "relay_mbit_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"LinkConfig.{name} must be finite and > 0 Mbit/s, got {value}")
        for name in (
            "peer_latency_s_min",
            "peer_latency_s_max",
            "trainer_latency_s",
            "relay_latency_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"LinkConfig.{name} must be finite and >= 0 seconds, got {value}")
        if self.peer_mbit_s_max < self.peer_mbit_s_min:
            raise ValueError(
                f"peer_mbit_s_max ({self.peer_mbit_s_max}) must be >= peer_mbit_s_min ({self.peer_mbit_s_min})"
            )
        if self.peer_latency_s_max < self.peer_latency_s_min:
            raise ValueError(
                f"peer_latency_s_max ({self.peer_latency_s_max}) must be >= peer_latency_s_min "
                f"({self.peer_latency_s_min})"
            )
        if not 0.0 <= self.relayed_share < 1.0:
            raise ValueError(f"relayed_share must be in [0, 1), got {self.relayed_share}")
        for name in ("num_relays", "values_per_sample", "tokens_per_sample"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LinkConfig.{name} must be an int >= 1, got {value!r}")
        if self.codec not in BYTES_PER_VALUE:
            raise ValueError(
                f"LinkConfig.codec must be one of {', '.join(CODEC_NAMES)}, got {self.codec!r}"
            )


class Link:
    """One node's connection: bytes per second, one-way latency, and when each direction is next free."""

    __slots__ = ("bytes_per_s", "latency_s", "up_free_at", "down_free_at", "relay")

    def __init__(self, mbit_s: float, latency_s: float, relay: Link | None = None) -> None:
        self.bytes_per_s = mbit_s * 1e6 / 8
        self.latency_s = latency_s
        self.up_free_at = 0.0
        self.down_free_at = 0.0
        self.relay = relay  # the relay a NAT-ed node's traffic crosses, or None


def draw_peer_link(config: LinkConfig, rng: random.Random, relays: list[Link]) -> Link:
    """A new peer's link: log-uniform bandwidth, uniform latency, a relay with ``relayed_share``."""
    low, high = math.log(config.peer_mbit_s_min), math.log(config.peer_mbit_s_max)
    mbit_s = math.exp(rng.uniform(low, high))
    latency_s = rng.uniform(config.peer_latency_s_min, config.peer_latency_s_max)
    relay = None
    if relays and rng.random() < config.relayed_share:
        relay = relays[rng.randrange(len(relays))]
    return Link(mbit_s, latency_s, relay)


def _hop(now: float, size: float, sender: Link, receiver: Link) -> float:
    """Store and forward over one sender uplink and one receiver downlink; returns arrival time."""
    start = max(now, sender.up_free_at)
    sender.up_free_at = start + size / sender.bytes_per_s
    arrive = sender.up_free_at + sender.latency_s
    start = max(arrive, receiver.down_free_at)
    receiver.down_free_at = start + size / receiver.bytes_per_s
    return receiver.down_free_at + receiver.latency_s


def transfer(now: float, size_bytes: float, sender: Link, receiver: Link) -> float:
    """Send ``size_bytes`` from ``sender`` to ``receiver`` at ``now``; returns when it has fully arrived.

    Books the time on every link crossed (so later messages queue behind it), relays included."""
    path = [sender]
    if sender.relay is not None:
        path.append(sender.relay)
    if receiver.relay is not None and receiver.relay is not sender.relay:
        path.append(receiver.relay)
    path.append(receiver)
    for a, b in zip(path, path[1:]):
        now = _hop(now, size_bytes, a, b)
    return now


def message_bytes(config: LinkConfig, samples: int, *, tokens: bool = False) -> float:
    """Wire bytes of one tensor of ``samples`` samples: token ids (8 bytes each) or boundary values."""
    if tokens:
        return 8.0 * samples * config.tokens_per_sample
    return BYTES_PER_VALUE[config.codec] * samples * config.values_per_sample


def hop_bytes(
    config: LinkConfig, samples: int, stage: int, num_stages: int, backward: bool, recompute: bool
) -> tuple[float, float]:
    """Wire bytes of one hop's request and reply: token ids into stage 0, activations forward, gradients
    backward (a recompute sends the inputs too); the last stage's forward answers with its input's
    gradient (loss and backward in one call), stage 0's backward with nothing."""
    inputs = message_bytes(config, samples, tokens=stage == 0)
    values = message_bytes(config, samples)
    if not backward:
        return inputs, (values if stage > 0 or stage < num_stages - 1 else 0.0)
    return values + (inputs if recompute else 0.0), (values if stage > 0 else 0.0)
