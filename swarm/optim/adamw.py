"""AdamW as every stage runs it: parameter groups, per-stage gradient clipping, and a guard against
non-finite steps.

Gradient clipping needs the norm over all stages, which no single stage knows. Approximation used: each
stage clips its own gradient to ``max_grad_norm / sqrt(num_stages)``. The global norm after clipping is
then always <= ``max_grad_norm``, and when the stages' norms are equal this is exactly global clipping.
Its effect versus exact clipping is measured in bench/convergence.py (bench/results/convergence.md).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from swarm.config import RunConfig
from swarm.optim.schedule import learning_rate

logger = logging.getLogger(__name__)


def adamw_param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (dim >= 2: Linear and Embedding weights) decay, vectors
    (biases, LayerNorm) do not. Every stage's optimizer and the single-process reference use them, so the
    swarm and the reference optimise the same objective. Each group keeps ``module.parameters()`` order."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def stage_clip_norm(run: RunConfig) -> float:
    """The per-stage clipping threshold that bounds the global norm by ``run.max_grad_norm`` (0 = off)."""
    return run.max_grad_norm / math.sqrt(run.model.num_stages)


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips its parameters' gradient norm to ``max_grad_norm`` first (0 = off) and skips a
    step whose gradient is not finite (the gradients are dropped, the parameters stay)."""

    def __init__(self, params, *, max_grad_norm: float, **kwargs):
        super().__init__(params, **kwargs)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm = float("nan")
        self.skipped_steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(
            grads, self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        )
        self.last_grad_norm = float(norm)
        if not math.isfinite(self.last_grad_norm):
            logger.error("gradient norm is %s: skipping this optimizer step", self.last_grad_norm)
            self.skipped_steps += 1
            self.zero_grad(set_to_none=True)
            return None
        return super().step(closure)


def build_stage_optimizer(params, run: RunConfig, *, lr: float | None = None) -> ClippedAdamW:
    """The optimizer every replica of a stage and the single-process reference use (same hyperparameters);
    ``params`` is a module (split into :func:`adamw_param_groups`) or parameter groups. Callers set each
    step's learning rate with :func:`swarm.optim.schedule.set_learning_rate`."""
    if isinstance(params, nn.Module):
        params = adamw_param_groups(params, run.weight_decay)
    return ClippedAdamW(
        params,
        lr=learning_rate(run, 0) if lr is None else lr,
        betas=(0.9, 0.95),
        max_grad_norm=stage_clip_norm(run),
    )
