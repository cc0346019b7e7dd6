"""GPT-style byte-level decoder, cut into pipeline stages from one ModelConfig.

The configs import without torch; the rest is imported on first use (see swarm.lazy).
"""

from typing import TYPE_CHECKING

from swarm.lazy import lazy_exports
from swarm.model.config import ALL_PRESETS, MODEL_PRESETS, AnyModelConfig, ModelConfig
from swarm.model.hfconfig import HF_PRESETS, HFModelConfig

if TYPE_CHECKING:
    from swarm.model.digest import is_digest, state_digest
    from swarm.model.full import FullModel, build_full_model, evaluate
    from swarm.model.generate import generate
    from swarm.model.stage import Stage, build_stage, stage_seed

__getattr__ = lazy_exports(
    globals(),
    {
        "is_digest": "swarm.model.digest",
        "state_digest": "swarm.model.digest",
        "FullModel": "swarm.model.full",
        "build_full_model": "swarm.model.full",
        "evaluate": "swarm.model.full",
        "generate": "swarm.model.generate",
        "Stage": "swarm.model.stage",
        "build_stage": "swarm.model.stage",
        "stage_seed": "swarm.model.stage",
    },
)

__all__ = [
    "ALL_PRESETS",
    "HF_PRESETS",
    "AnyModelConfig",
    "HFModelConfig",
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
