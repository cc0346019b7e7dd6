"""Stage optimizers without any networking: AdamW groups, per-stage clipping, the learning-rate schedule,
the stage optimizer interface and the lone replica's implementation. Imports no hivemind (the averaging
adapter, ``swarm.averaging``, builds on this package)."""

from swarm.optim.adamw import (
    ClippedAdamW,
    adamw_param_groups,
    build_stage_optimizer,
    stage_clip_norm,
)
from swarm.optim.later_batches import LaterBatches
from swarm.optim.schedule import learning_rate, set_learning_rate
from swarm.optim.stage_optimizer import LocalStageOptimizer, StageOptimizer, saved_step

__all__ = [
    "ClippedAdamW",
    "LaterBatches",
    "LocalStageOptimizer",
    "StageOptimizer",
    "adamw_param_groups",
    "build_stage_optimizer",
    "learning_rate",
    "set_learning_rate",
    "saved_step",
    "stage_clip_norm",
]
