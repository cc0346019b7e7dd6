"""A stage replica's optimizer: schedule and clipping, and checkpoints that resume the exact state."""

from __future__ import annotations

import logging
import math
import multiprocessing
from dataclasses import replace

import pytest
import torch
from conftest import local_executor

from swarm.averaging import step_group_bits
from swarm.averaging.hivemind_private import PartialResults
from swarm.config import RunConfig
from swarm.model import ModelConfig
from swarm.optim import LocalStageOptimizer, learning_rate, stage_clip_norm
from swarm.peer.checkpoint import CheckpointStore
from swarm.peer.executor import StageExecutor

MODEL = ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=8, num_stages=2, seed=5)
RUN = RunConfig(
    model=MODEL, target_batch_size=16, lr=3e-3, warmup_steps=2, total_steps=10, max_grad_norm=0.5
)


def _batch(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, MODEL.seq_len, MODEL.d_model, generator=g)  # (B, T, D)
    y = torch.randint(0, MODEL.vocab_size, (n, MODEL.seq_len), generator=g)  # (B, T)
    return x, y


def _feed(ex: StageExecutor, seeds: list[int]) -> None:
    for seed in seeds:
        x, y = _batch(seed)
        ex.forward_loss_backward(f"mb{seed}", x, y, x.shape[0])
        ex.commit(f"mb{seed}")


def _params(ex: StageExecutor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in ex.stage_module.named_parameters()}


def _assert_same(a: dict, b: dict, atol: float) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))
    )


def test_local_optimizer_applies_schedule_and_clipping():
    run = replace(
        RUN, max_grad_norm=0.2
    )  # this batch's gradient norm is about 0.5: it gets clipped
    threshold = 0.2 / math.sqrt(MODEL.num_stages)
    ex = local_executor(run, 1)
    assert isinstance(ex.optimizer, LocalStageOptimizer)
    # The same replica (same initial parameters) fed the same batch without stepping: its mean gradient.
    accumulating = local_executor(replace(run, target_batch_size=10_000), 1)
    _feed(accumulating, [1, 2, 3, 4])
    mean = [g / run.target_batch_size for g in accumulating.optimizer.grad_sums()]
    assert _norm(mean) > 0.2  # above the threshold, whether or not divided by sqrt(num_stages)
    _feed(ex, [1, 2, 3, 4])
    assert ex.step == 1 and ex.samples_accumulated == 0
    adamw = ex.optimizer.optimizer
    assert adamw.last_grad_norm == pytest.approx(_norm(mean), rel=1e-5)
    # AdamW's first moment after one step from zero is (1 - beta1) x the (clipped) gradient it used.
    for p, g in zip(ex.stage_module.parameters(), mean):
        expected = 0.1 * g * (threshold / _norm(mean))
        torch.testing.assert_close(adamw.state[p]["exp_avg"], expected, rtol=1e-4, atol=1e-9)
    assert adamw.param_groups[0]["lr"] == pytest.approx(learning_rate(run, 0))
    assert stage_clip_norm(run) == pytest.approx(threshold)


def test_checkpoint_round_trip_resumes_step_and_state(tmp_path):
    ex = local_executor(RUN, 1)
    _feed(ex, [1, 2, 3, 4, 5, 6, 7, 8])
    store = CheckpointStore(tmp_path)
    store.save(ex.state_dict(), run=RUN)
    fresh = local_executor(RUN, 1)
    fresh.load_state(store.load(1, run=RUN))
    assert fresh.step == ex.step == 2
    _assert_same(_params(fresh), _params(ex), atol=0)
    _feed(ex, [9, 10, 11, 12])
    # same data after the restart: same parameters (optimizer state restored)
    _feed(fresh, [9, 10, 11, 12])
    _assert_same(_params(fresh), _params(ex), atol=0)
    with pytest.raises(ValueError, match="another run config"):
        store.load(1, run=RunConfig(model=MODEL, lr=1e-2))
    assert store.load(0, run=RUN) is None


def test_partial_all_reduce_results_are_counted_across_the_averager_fork():
    """hivemind reports an all-reduce that came back partial only as a log warning in its averager's (forked)
    process; the compute thread must learn of it to reload its peers' state."""
    partial = PartialResults.install()
    # one counter per process, whatever the number of optimizers
    assert PartialResults.install() is partial
    before = partial.count.value

    def averager_process():
        logging.getLogger("hivemind.averaging.partition").warning(
            "Averaging: received 61.0% results"
        )
        logging.getLogger("hivemind.averaging.partition").warning("something else")

    child = multiprocessing.get_context("fork").Process(target=averager_process)
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0
    assert partial.count.value == before + 1
    # All-reduce groups are keyed by step: neighbouring steps never share a key.
    assert len({step_group_bits(step) for step in range(1000)}) == 1000
