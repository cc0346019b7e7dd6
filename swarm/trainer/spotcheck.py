"""Spot-checks: a trainer recomputes a share of its forward calls at another replica of the same stage and
compares, so a peer that returns plausible but wrong results (finite, well shaped: the reply checks pass them)
is caught and banned.

A check compares only what must be equal: two replies that name the same step and parameter digest (each peer
says which parameters it computed with, read on its compute thread right after the call) came from the same
parameters (averaging keeps replicas bit-identical), so the same input gives the same output up to the codec's
rounding and the order of float sums. Replies from different parameters (no averaging, a replica a step ahead, a
digest not yet hashed) are not compared: the check is inconclusive, never a false accusation.

The check runs beside the training (a task of its own, an eval-only forward: the checking peer keeps nothing and
counts nothing), so it costs the swarm ``share`` of a forward per call and the trainer no time. On a mismatch a
third replica decides: the one of the first two that disagrees with it is banned for the run; with no third
replica, or a third that agrees with neither, nobody is (logged, counted).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from swarm.errors import SwarmError
from swarm.states import PeerState
from swarm.trainer.reports import tensor_digest
from swarm.transport.security import PeerAddress

logger = logging.getLogger(__name__)


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||a|| (inf when the shapes differ)."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm().clamp_min(1e-12))


class SpotCheckMismatch(SwarmError):
    """A replica's result disagreed with two others' at the same step and parameters."""


@dataclass
class SpotCheckCounts:
    checked: int = 0  # compared with a second replica
    agreed: int = 0
    mismatched: int = 0  # a second replica disagreed (a third decided, or none could)
    inconclusive: int = 0  # no comparable replica, or it did not answer in time
    banned: list[str] = field(default_factory=list)


# An eval-only forward of the checked call's input at a given peer address: ((step, digest) it ran at, its result).
Recompute = Callable[[PeerAddress, float], Awaitable[tuple[tuple[int, str], torch.Tensor]]]


class CheckedCall(NamedTuple):
    """A forward call to check: what ``peer`` of ``stage`` answered (``result``) with the parameters ``version``
    (step, digest), how to ask another replica the same, and the call's size (forward-sample units, for its
    deadline)."""

    stage: int
    peer: str
    version: tuple[int, str]
    result: torch.Tensor
    recompute: Recompute
    work: float


class SpotChecker:
    def __init__(self, pipeline, *, share: float, tolerance: float, rng: random.Random):
        self.pipeline, self.share, self.tolerance, self.rng = pipeline, share, tolerance, rng
        self.counts = SpotCheckCounts()
        self._tasks: set[asyncio.Task] = set()

    def sampled(self) -> bool:
        """Whether to check this call (probability ``share``): asked first, so an unchecked call costs nothing."""
        return self.share > 0 and self.rng.random() < self.share

    def check(self, call: CheckedCall) -> None:
        """Check in the background that another replica of the stage computes ``call.result`` from the same
        input with the same parameters."""
        if not call.version[
            1
        ]:  # the peer's parameters at that step were not hashed: nothing to compare with
            self.counts.inconclusive += 1
            return
        task = asyncio.create_task(self._check(call), name="spot-check")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self) -> None:
        """Wait for the checks under way."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _others(self, stage: int, peer: str, step: int) -> list[str]:
        """Other serving replicas of ``stage`` in the order to ask them (popped from the end): those whose records
        announce ``step`` last, so first (they are likeliest to answer with the same parameters), at random
        within each group."""
        pipeline = self.pipeline
        others = [
            (r.step == step, self.rng.random(), pid)
            for pid, r in pipeline.records[stage].items()
            if pid != peer and pid not in pipeline.banned_for_run and r.state == PeerState.SERVING
        ]
        return [pid for *_, pid in sorted(others)]

    async def _next_opinion(
        self, call: CheckedCall, candidates: list[str]
    ) -> tuple[str | None, torch.Tensor | None]:
        """Ask ``candidates`` (popping them) until one answers with the call's parameters: (it, its result)."""
        while candidates:
            peer = candidates.pop()
            if (result := await self._opinion(call, peer)) is not None:
                return peer, result
        return None, None

    async def _opinion(self, call: CheckedCall, peer: str) -> torch.Tensor | None:
        """``peer``'s result for the call's input, if it computed it with the same parameters."""
        pipeline = self.pipeline
        record = pipeline.records[call.stage].get(peer)
        if record is None:
            return None
        timeout_s = pipeline.call_timeout_s(call.stage, record, call.work)
        try:
            answered_with, result = await call.recompute(PeerAddress.of(record), timeout_s)
        except SwarmError as e:
            logger.debug("spot-check at stage %d peer %s failed: %s", call.stage, peer, e)
            return None
        return result if answered_with == call.version else None

    def _agree(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return relative_distance(a, b) <= self.tolerance

    async def _check(self, call: CheckedCall) -> None:
        stage, peer, version, result = call.stage, call.peer, call.version, call.result
        counts, step = self.counts, version[0]
        candidates = self._others(stage, peer, step)
        checker, second = await self._next_opinion(call, candidates)
        if second is None:
            counts.inconclusive += 1
            return
        counts.checked += 1
        if self._agree(result, second):
            counts.agreed += 1
            return
        counts.mismatched += 1
        third_peer, third = await self._next_opinion(call, candidates)
        if third is not None and self._agree(second, third) and not self._agree(result, third):
            liar, other, lie, truth = peer, checker, result, second
        elif third is not None and self._agree(result, third) and not self._agree(second, third):
            liar, other, lie, truth = checker, peer, second, result
        else:
            logger.warning(
                "spot-check at stage %d, step %d: peers %s and %s disagree (relative distance %.3g) and no third "
                "replica decided; nobody banned",
                stage,
                step,
                peer,
                checker,
                relative_distance(result, second),
            )
            return
        # the lie's distance from the agreed result, relative to that result: the same whichever was asked first
        distance = relative_distance(truth, lie)
        counts.banned.append(liar)
        self.pipeline._ban_for_run(
            stage,
            liar,
            SpotCheckMismatch(
                f"its result at step {step} was {distance:.3g} (relative) from two other replicas' at the same "
                f"parameters (tolerance {self.tolerance})"
            ),
            f"spot-check: {other} and a third replica agree, it does not",
            report={
                "kind": "mismatch",
                "microbatch_id": "spot-check",
                "step": step,
                "param_digest": version[1],
                "result_digest": tensor_digest(lie),
                "expected_digest": tensor_digest(truth),
                "distance": min(distance, 1e300),
                "witnesses": f"{other},{third_peer}",
            },
        )
