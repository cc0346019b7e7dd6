"""What a microbatch costs and comes to, shared by the relayed and the push paths (swarm.trainer.pipeline,
swarm.trainer.push)."""

from __future__ import annotations

from dataclasses import dataclass

# Relative cost of the calls, in forward passes: backward costs about twice a forward (a recompute adds one).
FORWARD_COST, BACKWARD_COST = 1.0, 2.0


@dataclass
class MicrobatchResult:
    loss: float
    samples: int
    tokens: int
    attempts_failed: int  # calls that failed and were retried elsewhere
