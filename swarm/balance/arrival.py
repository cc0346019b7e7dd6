"""Where a newcomer goes: the stage where its capacity raises the swarm throughput most."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

__all__ = ["arrival_delay_s", "choose_stage_on_arrival"]


def choose_stage_on_arrival(
    stage_throughputs: Sequence[float],
    my_throughput_by_stage: Sequence[float] | float,
    rng: random.Random,
) -> int:
    """The stage index where a newcomer adds the most swarm throughput.

    ``stage_throughputs[s]`` is stage ``s``'s current throughput, samples/s (serving peers, plus
    starting ones so that concurrent newcomers see each other). ``my_throughput_by_stage`` is the
    newcomer's estimated samples/s per stage, or one number for every stage.

    Picks ``argmax_s min_j (T[j] + mine[s] * (j == s))``, the swarm throughput after joining ``s``.
    Ties (e.g. two empty stages: both leave the swarm at 0) go to the weakest stage, then to a
    uniform draw from ``rng``. O(stages). Raises ``ValueError`` for an empty list, a length
    mismatch, capacities that are negative or not finite, or an estimate that is not > 0.
    """
    capacities = [float(t) for t in stage_throughputs]
    num_stages = len(capacities)
    if num_stages == 0:
        raise ValueError("stage_throughputs is empty; the run must have at least one stage")
    for stage, value in enumerate(capacities):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"stage_throughputs[{stage}] must be finite and >= 0 samples/s, got {value}"
            )
    if isinstance(my_throughput_by_stage, (int, float)):
        mine = [float(my_throughput_by_stage)] * num_stages
    else:
        mine = [float(t) for t in my_throughput_by_stage]
        if len(mine) != num_stages:
            raise ValueError(
                f"my_throughput_by_stage has {len(mine)} entries for {num_stages} stages; give one "
                "estimate per stage or a single number"
            )
    for stage, value in enumerate(mine):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"my throughput for stage {stage} must be finite and > 0 samples/s, got {value}"
            )

    # The min over the other stages is the smallest capacity, except for the weakest stage itself,
    # where it is the second smallest: two numbers make the whole scan O(stages).
    weakest = min(range(num_stages), key=capacities.__getitem__)
    second = min((capacities[s] for s in range(num_stages) if s != weakest), default=math.inf)
    scores = []
    for stage in range(num_stages):
        others = second if stage == weakest else capacities[weakest]
        scores.append(min(others, capacities[stage] + mine[stage]))
    best = max(scores)
    tied = [s for s in range(num_stages) if scores[s] == best]
    lowest = min(capacities[s] for s in tied)
    weakest_tied = [s for s in tied if capacities[s] == lowest]
    return weakest_tied[rng.randrange(len(weakest_tied))]


def arrival_delay_s(rng: random.Random, max_delay_s: float) -> float:
    """A delay, seconds, uniform in ``[0, max_delay_s]``, to wait before choosing a stage.

    Peers started together (a batch of spot instances) would otherwise read the same view and all
    pick the same weakest stage. After the delay the newcomer must read the stage records from the
    DHT again, call :func:`choose_stage_on_arrival` on that fresh view, and announce itself
    "starting" on the chosen stage at once, so the next newcomers count it.
    """
    if not (math.isfinite(max_delay_s) and max_delay_s >= 0):
        raise ValueError(f"max_delay_s must be finite and >= 0 seconds, got {max_delay_s}")
    return rng.uniform(0.0, max_delay_s)
