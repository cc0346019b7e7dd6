"""Gradients a trainer's microbatches left at replicas whose stage has not yet stepped on their global batch.

A replica that averages keeps the gradient sums of the microbatches it counted until its stage's all-reduce of
that batch. Killed before then, it takes them along: its stage would step on less than the global batch (the
samples lost). The trainer knows which replica counted what (the commit confirmed it), and it still holds what
it would take to compute those gradients again (the stage's inputs and output gradients, as for a recompute).
So until a stage has stepped on a batch, the trainer keeps, for each microbatch of it, where its gradient lies
and how to compute it again; a replica found gone before its stage stepped has its part computed again at a
live replica of the stage, tagged with the same batch (see :meth:`StageSteps.close_batch`).

Bounded: entries go once every serving replica of their stage has stepped past their batch, and the trainer
keeps them only while it bounds how far it runs ahead of the stages (averaging stages; see Trainer).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Computes a microbatch's gradient of one stage again at some live replica and makes sure it is counted there
# exactly once; returns the peer that counted it.
Redo = Callable[[], Awaitable[str]]
# batches further behind the stage's most advanced replica than this are forgotten whoever held them
STALE_STEPS = 2


@dataclass
class Held:
    batch_step: int
    peer: str  # the replica that counted it
    microbatch_id: str
    redo: Redo


class Holdings:
    def __init__(self, num_stages: int):
        # set by the trainer when it bounds how far it runs ahead of the stages
        self.enabled = False
        self._held: list[list[Held]] = [[] for _ in range(num_stages)]
        # gradients computed again because the replica holding them left before its step
        self.redone = 0

    def add(self, stage: int, batch_step: int | None, peer: str, microbatch_id: str, redo: Redo):
        """``peer`` counted this microbatch's gradient of ``stage`` toward step ``batch_step``."""
        if self.enabled and batch_step is not None:
            self._held[stage].append(Held(batch_step, peer, microbatch_id, redo))

    def prune(self, stage: int, peer_step: Callable[[str], int]) -> None:
        """Forget what is averaged: the gradients of batches their replica has stepped on (``peer_step(peer)``: the
        step the trainer last saw it at), and of batches the stage left more than ``STALE_STEPS`` steps behind
        (their replica's record is gone and no step of it was seen: too late for their step anyway)."""
        held = self._held[stage]
        latest = max((peer_step(h.peer) for h in held if h.peer), default=0)
        self._held[stage] = [
            h
            for h in held
            if h.batch_step >= (peer_step(h.peer) if h.peer else 0)
            and h.batch_step >= latest - STALE_STEPS
        ]

    def release(self, stage: int, peer: str) -> None:
        """``peer`` drains: it hands in what it holds itself (never computed again here)."""
        self._held[stage] = [h for h in self._held[stage] if h.peer != peer]

    def holders(self, stage: int, batch_step: int) -> set[str]:
        """The replicas of ``stage`` that counted gradients of batch ``batch_step``."""
        return {h.peer for h in self._held[stage] if h.batch_step == batch_step and h.peer}

    def peers(self, stage: int) -> set[str]:
        """The replicas of ``stage`` holding any microbatch kept here."""
        return {h.peer for h in self._held[stage] if h.peer}

    def held_by(self, stage: int, peers: set[str]) -> list[Held]:
        return [h for h in self._held[stage] if h.peer in peers]

    def count(self) -> int:
        return sum(len(held) for held in self._held)

    async def redo(
        self,
        stage: int,
        gone: set[str],
        *,
        from_step: int,
        left_out: Callable[[int, str], bool] = lambda batch_step, peer: False,
    ) -> None:
        """Compute again, at live replicas, what the replicas ``gone`` of ``stage`` held of batches ``from_step`` and
        later (batches no live replica of the stage has stepped on), and of earlier batches whose steps were taken
        without them (``left_out(batch_step, peer)``: the live replicas' Info says whose gradients those steps
        averaged). A replica gone before its stage stepped, or left out of the step (killed while the trainer's
        close asked its step: named in no group), took its part along; computed again, a batch already stepped on
        gets it late, in the stage's next step (as a replica that missed its group hands its own over). Once a
        live replica has stepped on a batch and may have done so with the gone replica's part, it is left alone:
        computed again, it could count twice. One at a time (a handful per batch; each is one backward call)."""
        for held in self.held_by(stage, gone):
            late = held.batch_step < from_step
            if late and not left_out(held.batch_step, held.peer):
                continue
            # taken: a close running at the same time leaves it alone
            left, held.peer = held.peer, ""
            logger.warning(
                "stage %d replica %s left %s batch %d: computing the gradient of microbatch %s again%s",
                stage,
                left,
                "out of the step on" if late else "before its stage stepped on",
                held.batch_step,
                held.microbatch_id,
                " (applied late, in the stage's next step)" if late else "",
            )
            held.peer = await held.redo()
            self.redone += 1
