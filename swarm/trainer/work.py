"""What a microbatch costs and comes to, shared by the relayed and the push paths (swarm.trainer.pipeline,
swarm.trainer.push)."""

from __future__ import annotations

from dataclasses import dataclass

# Relative cost of the calls, in forward passes (routing's unit, shared with the simulator).
from swarm.routing.work import BACKWARD_COST, FORWARD_COST

__all__ = ["BACKWARD_COST", "FORWARD_COST", "MicrobatchResult"]


@dataclass
class MicrobatchResult:
    loss: float
    samples: int
    tokens: int
    attempts_failed: int  # calls that failed and were retried elsewhere
