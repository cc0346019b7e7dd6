"""Averaging replicas of a stage with hivemind: the peers of a stage all-reduce gradients and step together.

Built on :mod:`swarm.optim` (the optimizer each replica runs) and used by the peer daemon. Importing this
package imports hivemind and checks its version (:mod:`swarm.averaging.hivemind_private`, imported before the
optimizer so the check runs first): the daemon imports hivemind for its DHT anyway, and a peer on another
hivemind version fails at start with a sentence, not mid-run.
"""

from swarm.averaging.config import GRAD_COMPRESSIONS, AveragingConfig
from swarm.averaging.hivemind_private import PINNED_HIVEMIND, UnsupportedHivemind
from swarm.averaging.keys import STEP_KEY_BITS, stage_run_id, step_group_bits
from swarm.averaging.optimizer import HivemindStageOptimizer

__all__ = [
    "GRAD_COMPRESSIONS",
    "PINNED_HIVEMIND",
    "STEP_KEY_BITS",
    "AveragingConfig",
    "HivemindStageOptimizer",
    "UnsupportedHivemind",
    "stage_run_id",
    "step_group_bits",
]
