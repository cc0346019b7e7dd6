"""The learning-rate schedule every stage follows: linear warmup, then optional cosine decay to 10% of the peak.

A function of the run config and the optimizer step only, so every replica of every stage, and the
single-process reference, set the same rate at the same step without talking to each other.
"""

from __future__ import annotations

import math

import torch

from swarm.config import RunConfig


def learning_rate(run: RunConfig, step: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup over ``run.warmup_steps``, then
    cosine decay to ``0.1 * run.lr`` at ``run.total_steps`` (constant after warmup when ``total_steps`` is 0)."""
    if step < run.warmup_steps:
        return run.lr * (step + 1) / run.warmup_steps
    if run.total_steps <= run.warmup_steps:
        return run.lr
    progress = min(1.0, (step - run.warmup_steps) / (run.total_steps - run.warmup_steps))
    return run.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def set_learning_rate(optimizer: torch.optim.Optimizer, run: RunConfig, step: int) -> None:
    """Set every parameter group of ``optimizer`` to the schedule's rate for optimizer step ``step``."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(run, step)
