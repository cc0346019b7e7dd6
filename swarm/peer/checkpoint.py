"""A peer's checkpoints: its stage's parameters and optimizer state (with the step), one file per stage.

Files are written atomically (temporary file, then rename), so a peer killed mid-write leaves the previous
checkpoint intact. Each file records the run config's fingerprint: a checkpoint of another run's model is
refused with a sentence instead of being loaded into the wrong shapes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from swarm.config import RunConfig


class CheckpointStore:
    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def path(self, stage: int) -> Path:
        return self.directory / f"stage{stage}.pt"

    def save(self, state: dict, *, run: RunConfig) -> Path:
        """Write ``state`` (``StageExecutor.state_dict()``: stage, params, optimizer, step) for its stage."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(state["stage"])
        tmp = path.with_suffix(".pt.tmp")
        torch.save({**state, "config_hash": run.fingerprint(), "run": run.to_dict()}, tmp)
        tmp.replace(path)
        return path

    def load(self, stage: int, *, run: RunConfig) -> dict | None:
        """The saved state of ``stage``, or None if there is none. Raises ValueError if it was written for a
        run with another config (delete it or use another --checkpoint-dir)."""
        path = self.path(stage)
        if not path.exists():
            return None
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state.get("config_hash") != run.fingerprint():
            raise ValueError(
                f"checkpoint {path} was written for another run config ({state.get('run')}); "
                f"delete it or point --checkpoint-dir elsewhere"
            )
        return state
