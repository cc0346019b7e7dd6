"""A peer's checkpoints: its stage's parameters and optimizer state (with the step), one file per stage.

Files are written atomically and durably (a unique temporary file, fsynced, then renamed: see
:mod:`swarm.durable`), so a peer killed mid-write leaves the previous checkpoint intact, and read with
``weights_only=True``, so a planted file cannot run code. Each file records the run config's fingerprint:
a checkpoint of another run's model is refused with a sentence instead of being loaded into the wrong shapes.
"""

from __future__ import annotations

import os
from pathlib import Path

from swarm.config import RunConfig
from swarm.durable import load_tensors, save_atomic


class CheckpointStore:
    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def path(self, stage: int) -> Path:
        return self.directory / f"stage{stage}.pt"

    def save(self, state: dict, *, run: RunConfig) -> Path:
        """Write ``state`` (``StageExecutor.state_dict()``: stage, params, optimizer, step) for its stage."""
        return save_atomic(
            {**state, "config_hash": run.fingerprint(), "run": run.to_dict()},
            self.path(state["stage"]),
        )

    def load(self, stage: int, *, run: RunConfig) -> dict | None:
        """The saved state of ``stage``, or None if there is none. Raises ValueError if it was written for a
        run with another config (delete it or use another --checkpoint-dir), or holds anything but tensors
        and plain values."""
        path = self.path(stage)
        if not path.exists():
            return None
        state = load_tensors(path)
        if not isinstance(state, dict) or state.get("config_hash") != run.fingerprint():
            raise ValueError(
                f"checkpoint {path} was written for another run config ({state.get('run')}); "
                f"delete it or point --checkpoint-dir elsewhere"
            )
        return state
