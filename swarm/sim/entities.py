"""What a simulated swarm is made of: peers, microbatches, the requests between them, and the event kinds.

Plain slotted classes (the simulator creates millions of requests): :mod:`swarm.sim.engine` moves them
through events.
"""

from __future__ import annotations

import math

from swarm.routing import StageRequest
from swarm.states import PeerState

SERVING, STARTING, DRAINING = PeerState.SERVING, PeerState.STARTING, PeerState.DRAINING
DEAD = "dead"  # the simulator's own: a killed peer, never announced

# Event kinds, in the order ties at equal times are processed.
(
    DONE,
    FAIL,
    RETRY,
    LEAVE,
    READY,
    DEATH,
    PREEMPT,
    ARRIVE,
    JOIN,
    DISCOVER,
    REBALANCE,
    SAMPLE,
    REPLY,  # a peer finished a request; its reply starts over the links (only when links are modelled)
) = range(13)


class SimPeer:
    __slots__ = (
        "pid",
        "speed",
        "stage",
        "state",
        "target",
        "free_at",
        "outstanding",
        "generation",
        "link",
    )

    def __init__(self, pid: str, speed: float, stage: int, state: PeerState | str) -> None:
        self.pid = pid
        self.speed = speed  # samples/s forward + backward on a stage of cost 1
        self.stage = stage
        self.state = state
        self.target = stage  # destination while draining
        self.free_at = 0.0  # when its FIFO queue empties, seconds
        # Insertion-ordered (not a set of objects hashed by address): kills must fail requests in
        # the same order in every process, or equal seeds would give different runs.
        self.outstanding: dict[SimRequest, None] = {}
        # Bumps on each stage change: activations of an older generation are gone.
        self.generation = 0
        self.link = None  # its swarm.sim.links.Link when links are modelled


class SimMicrobatch:
    __slots__ = (
        "trainer",
        "stage",
        "backward",
        "fwd_peer",
        "fwd_generation",
        "request",
        "started_at",
    )

    def __init__(self, trainer: int, num_stages: int, now: float) -> None:
        self.trainer = trainer
        self.stage = 0
        self.backward = False
        self.fwd_peer: list[str | None] = [None] * num_stages
        self.fwd_generation = [0] * num_stages
        self.request: StageRequest | None = None  # the current hop through its retries
        self.started_at = now


class SimRequest:
    __slots__ = (
        "mb",
        "pid",
        "stage",
        "sent_at",
        "finish",
        "done",
        "error",
        "deadline_at",
        "reply_bytes",
        "compute_s",
    )

    def __init__(self, mb: SimMicrobatch, pid: str, stage: int, sent_at: float) -> None:
        self.mb = mb
        self.pid = pid
        self.stage = stage
        self.sent_at = sent_at
        self.finish = math.inf  # when the peer finishes computing it
        self.done = False
        self.error: Exception | None = None  # how it fails, if it does; None: a transport failure
        self.deadline_at = math.inf  # when the trainer stops waiting for the reply
        self.reply_bytes = 0.0  # wire bytes of the reply (when links are modelled)
        self.compute_s = (
            0.0  # the peer's compute for it, which its reply reports (ReplyMeta.compute_s)
        )
