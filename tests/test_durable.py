"""Durable files: checkpoints and exports are written whole or not at all, and read without running code."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from swarm.config import RunConfig
from swarm.durable import load_tensors, save_atomic
from swarm.model import build_stage
from swarm.optim import LocalStageOptimizer
from swarm.peer.checkpoint import CheckpointStore
from swarm.peer.executor import StageExecutor


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("fails half-way through the write")


class _RunsCode:
    """What an attacker plants: unpickling it calls a function of the attacker's choice."""

    def __reduce__(self):
        return (os.getcwd, ())


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "stage0.pt"
    save_atomic({"w": torch.ones(3)}, path)
    with pytest.raises(RuntimeError, match="half-way"):
        save_atomic({"w": torch.zeros(3), "bad": _Unpicklable()}, path)
    assert torch.equal(load_tensors(path)["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage0.pt"]


def test_a_file_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "planted.pt"
    with open(path, "wb") as f:
        pickle.dump({"w": _RunsCode()}, f)
    with pytest.raises(ValueError, match="planted.pt"):
        load_tensors(path)


def test_a_checkpoint_round_trips_through_weights_only(tmp_path):
    run = RunConfig()
    stage = build_stage(run.model, 0)
    executor = StageExecutor(stage, run, optimizer=LocalStageOptimizer(stage, run))
    store = CheckpointStore(tmp_path)
    path = store.save(executor.state_dict(), run=run)
    torch.load(path, weights_only=True)  # the format itself is weights-only
    state = store.load(0, run=run)
    assert state["step"] == 0
    executor.load_state(state)
    assert [p.name for p in tmp_path.iterdir()] == ["stage0.pt"]
