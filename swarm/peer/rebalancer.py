"""Where a peer serves: the stage it picks on arrival and its periodic moves to the bottleneck stage.

The decisions are :mod:`swarm.balance`'s pure policy; this module reads the swarm from the DHT, writes
the claims that let at most a budget of peers leave a stage per period, and asks the peer to move (through a
callback: it never sees the peer itself).
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
from collections.abc import Awaitable, Callable

from hivemind.utils import get_dht_time

from swarm.balance import (
    PeerRecord,
    RebalanceConfig,
    SwarmView,
    arrival_delay_s,
    choose_stage_on_arrival,
    claim_key,
    decide_move,
    is_my_turn,
    period_index,
)
from swarm.discovery.dht import RunDirectory
from swarm.discovery.records import StageRecord
from swarm.model import ModelConfig
from swarm.states import PeerState

logger = logging.getLogger(__name__)


def stage_costs(model: ModelConfig) -> list[float]:
    """Relative compute per sample of each stage (multiply-adds per token), so a peer's speed on one
    stage predicts its speed on another: blocks cost ~12 d^2 + 2 T d each, the last stage adds the head."""
    d, t = model.d_model, model.seq_len
    costs = []
    for stage in range(model.num_stages):
        cost = len(model.stage_layers(stage)) * (12 * d * d + 2 * t * d)
        if stage == model.num_stages - 1:
            cost += d * model.vocab_size
        costs.append(float(cost))
    return costs


def _capacity(records: dict[str, StageRecord]) -> float:
    return sum(
        r.throughput for r in records.values() if r.state in (PeerState.SERVING, PeerState.STARTING)
    )


def estimate_my_throughput(
    stages: list[dict[str, StageRecord]], costs: list[float]
) -> list[float] | float:
    """Before it has measured anything, a newcomer assumes it is a typical peer: the median announced
    speed, converted between stages by their relative cost."""
    normalised = [
        r.throughput * costs[s]
        for s, recs in enumerate(stages)
        for r in recs.values()
        if r.throughput > 0
    ]
    if not normalised:
        return 1.0  # nobody measured yet: only the relative order of stages matters
    base = statistics.median(normalised)
    return [base / c for c in costs]


async def choose_arrival_stage(
    directory: RunDirectory, model: ModelConfig, config: RebalanceConfig, rng: random.Random
) -> int:
    """Wait a short random delay (so peers arriving together see each other's "starting" records), then
    pick the stage where this peer adds the most swarm throughput."""
    await asyncio.sleep(arrival_delay_s(rng, config.arrival_max_delay_s))
    stages = await directory.all_stages(model.num_stages)
    costs = stage_costs(model)
    stage = choose_stage_on_arrival(
        [_capacity(recs) for recs in stages], estimate_my_throughput(stages, costs), rng
    )
    logger.info(
        "arriving peer picks stage %d (stage capacities %s samples/s)",
        stage,
        [round(_capacity(recs), 1) for recs in stages],
    )
    return stage


async def neediest_other_stage(
    directory: RunDirectory, model: ModelConfig, *, peer_id: str, current: int
) -> int | None:
    """Where an operator's move (``swarm peer`` on SIGUSR1) goes: the stage other than ``current`` with the least
    capacity (samples/s of its serving and starting peers, lowest index on a tie). None, logged, when this peer is
    the last serving replica of ``current`` (a move would empty it) or the run has one stage."""
    if model.num_stages < 2:
        logger.warning("peer %s: not moving on request: the run has one stage", peer_id)
        return None
    stages = await directory.all_stages(model.num_stages)
    others_here = [
        pid for pid, r in stages[current].items() if pid != peer_id and r.state == PeerState.SERVING
    ]
    if not others_here:
        logger.warning(
            "peer %s: not moving on request: it is the last serving replica of stage %d (start another "
            "peer for that stage first)",
            peer_id,
            current,
        )
        return None
    capacities = {
        stage: _capacity({pid: r for pid, r in recs.items() if pid != peer_id})
        for stage, recs in enumerate(stages)
        if stage != current
    }
    stage = min(capacities, key=lambda s: (capacities[s], s))
    logger.info(
        "peer %s moves from stage %d to stage %d on request (stage capacities %s samples/s)",
        peer_id,
        current,
        stage,
        {s: round(c, 1) for s, c in capacities.items()},
    )
    return stage


async def read_view(directory: RunDirectory, model: ModelConfig, period: int) -> SwarmView:
    stages = await directory.all_stages(model.num_stages)
    claims = {}
    for stage in range(model.num_stages):
        claimers = await directory.claimers(claim_key(stage, period))
        if claimers:
            claims[(stage, period)] = claimers
    return SwarmView(
        stages=[
            {pid: PeerRecord(r.throughput, r.state) for pid, r in recs.items()} for recs in stages
        ],
        claims=claims,
        last_moved_s={
            pid: r.last_moved_s for recs in stages for pid, r in recs.items() if r.last_moved_s > 0
        },
        stage_costs=stage_costs(model),
    )


class Rebalancer:
    """Once per period (aligned on DHT time, so peers decide on about the same view), decide whether this
    peer should move to the bottleneck stage; claim the move; move if the claim wins.

    ``state()`` is the peer's state now (only a serving peer moves); ``move(stage_index,
    expected_throughput)`` drains the peer and moves it, returning once it serves the new stage (False: it did not
    move, another move or a drain was under way)."""

    def __init__(
        self,
        directory: RunDirectory,
        model: ModelConfig,
        config: RebalanceConfig,
        *,
        peer_id: str,
        state: Callable[[], PeerState],
        move: Callable[[int, float], Awaitable[bool]],
    ):
        self.directory = directory
        self.model = model
        self.config = config
        self.peer_id = peer_id
        self._state = state
        self._move = move
        self.moves = 0

    async def run(self) -> None:
        period_s = self.config.period_s
        while True:
            now = get_dht_time()
            # Decide a little after each period boundary: heartbeats of the last moves have landed by then.
            next_at = (period_index(now, period_s) + 1.1) * period_s
            await asyncio.sleep(max(0.0, next_at - now))
            try:
                await self.step()
            except Exception as e:  # a DHT hiccup skips one period; it must not kill the peer
                logger.warning("rebalancing check failed: %s", e)

    async def step(self) -> bool:
        """One decision; returns True if this peer moved."""
        if self._state() != PeerState.SERVING:
            return False
        now = get_dht_time()
        period = period_index(now, self.config.period_s)
        view = await read_view(self.directory, self.model, period)
        move = decide_move(view, self.peer_id, now, self.config)
        if move is None:
            return False
        key = claim_key(move.from_stage, period)
        await self.directory.claim(key, ttl_s=2 * self.config.period_s)
        # Let claims of peers that read a different view land, then the deterministic winner goes.
        await asyncio.sleep(min(1.0, 0.1 * self.config.period_s))
        claimers = await self.directory.claimers(key)
        if not is_my_turn(claimers, self.peer_id, period, budget=move.budget):
            return False
        logger.info(
            "moving from stage %d to stage %d: swarm %.1f -> %.1f samples/s planned",
            move.from_stage,
            move.to_stage,
            move.swarm_throughput,
            move.planned_throughput,
        )
        if not await self._move(move.to_stage, move.throughput_to):
            return False
        self.moves += 1
        return True
