"""Averaging replicas of a stage with hivemind: the peers of a stage all-reduce gradients and step together.

Built on :mod:`swarm.optim` (the optimizer each replica runs) and used by the peer daemon. Importing this
package checks the hivemind version (without importing hivemind: its configs are read by `swarm peer --help`)
so that a peer on another version fails at start with a sentence, not mid-run; the optimizer, which imports
hivemind and its private parts (:mod:`swarm.averaging.hivemind_private`), is imported on first use.
"""

from typing import TYPE_CHECKING

from swarm.averaging.config import GRAD_COMPRESSIONS, AveragingConfig
from swarm.averaging.keys import STEP_KEY_BITS, stage_run_id, step_group_bits
from swarm.averaging.version import PINNED_HIVEMIND, UnsupportedHivemind, check_hivemind_version
from swarm.lazy import lazy_exports

check_hivemind_version()

if TYPE_CHECKING:
    from swarm.averaging.optimizer import HivemindStageOptimizer

__getattr__ = lazy_exports(globals(), {"HivemindStageOptimizer": "swarm.averaging.optimizer"})

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
