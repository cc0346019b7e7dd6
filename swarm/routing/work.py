"""The unit routing measures in: a call's work in forward passes of one sample.

The trainer sizes every call in these units (a forward is ``samples * FORWARD_COST``, a backward at the peer
that holds the inputs ``samples * BACKWARD_COST``, the last stage's forward + loss + backward, or a backward
that recomputes, ``samples * (FORWARD_COST + BACKWARD_COST)``), so the router's throughput EMAs and deadlines
fit a call of any kind. The simulator sizes its requests with the same numbers (swarm.sim.engine): a model
that gave a backward the deadline of a forward would shed backwards the trainer never sheds.
"""

from __future__ import annotations

__all__ = ["BACKWARD_COST", "FORWARD_COST", "STEP_COST"]

# Relative cost of the calls, in forward passes: backward costs about twice a forward (a recompute adds one).
FORWARD_COST, BACKWARD_COST = 1.0, 2.0
# One sample's forward + backward: peers announce samples/s of it, routing counts forward passes.
STEP_COST = FORWARD_COST + BACKWARD_COST
