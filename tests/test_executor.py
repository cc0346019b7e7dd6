"""The stage executor's speed bookkeeping: calibration, and the emulated slow device used for fault injection."""
from __future__ import annotations

import time

import pytest
import torch

from swarm.config import RunConfig
from swarm.model import ModelConfig, build_stage
from swarm.peer.executor import StageExecutor

MODEL = ModelConfig(d_model=64, n_heads=2, n_layers=2, seq_len=32, num_stages=2, seed=3)
RUN = RunConfig(model=MODEL, target_batch_size=64)


def test_emulated_slow_device_is_slower_by_its_factor_and_measures_it():
    fast = StageExecutor(build_stage(MODEL, 0), RUN)
    slow = StageExecutor(build_stage(MODEL, 0), RUN, slowdown=5.0)
    fast.calibrate(8)
    slow.calibrate(8)
    # The seed of the announced speed is the calibrated full speed divided by the factor, exactly.
    assert slow.throughput == pytest.approx(1.0 / (5.0 * (slow._base_fwd_s + slow._base_bwd_s)))
    tokens = torch.randint(0, MODEL.vocab_size, (8, MODEL.seq_len))
    t0 = time.perf_counter()
    slow.forward("mb", tokens, keep=True)
    took = time.perf_counter() - t0
    # The call holds the compute thread for 5x its compute: at least (5 - 1) x the calibrated full-speed time
    # (less a margin: calibration kept the fastest of its runs).
    assert took >= 0.8 * 5 * slow._base_fwd_s * 8
    before = slow.throughput
    grad = torch.randn(8, MODEL.seq_len, MODEL.d_model)
    slow.backward("mb", grad, None, 8)
    slow.commit("mb")
    # What it measures includes the emulated time, so it stays near a fifth of the full speed.
    assert slow.throughput < 0.5 * fast.throughput and slow.throughput == pytest.approx(before, rel=0.5)


def test_slowdown_below_one_is_refused():
    with pytest.raises(ValueError, match="slowdown is a factor >= 1"):
        StageExecutor(build_stage(MODEL, 0), RUN, slowdown=0.5)
