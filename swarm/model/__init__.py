"""GPT-style byte-level decoder, cut into pipeline stages from one ModelConfig."""

from swarm.model.config import MODEL_PRESETS, ModelConfig
from swarm.model.digest import is_digest, state_digest
from swarm.model.full import FullModel, build_full_model, evaluate
from swarm.model.generate import generate
from swarm.model.stage import Stage, build_stage, stage_seed

__all__ = [
    "MODEL_PRESETS",
    "FullModel",
    "ModelConfig",
    "Stage",
    "build_full_model",
    "build_stage",
    "evaluate",
    "generate",
    "is_digest",
    "stage_seed",
    "state_digest",
]
