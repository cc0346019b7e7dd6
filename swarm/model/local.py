"""Single-process training of the FullModel: the reference baseline the swarm is measured against."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from swarm.model.config import ModelConfig
from swarm.model.full import FullModel, build_full_model


class BatchSource(Protocol):
    """What train_local needs from a corpus (swarm.data.ByteCorpus satisfies it)."""

    def sample(self, split: str, batch_size: int, seq_len: int, generator: torch.Generator) -> Tensor: ...

    def val_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[Tensor]: ...


def adamw_param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (dim >= 2: Linear and Embedding weights) decay, vectors
    (biases, LayerNorm) do not. Used by the baseline and meant for every stage's optimizer, so the
    swarm and the baseline optimise the same objective."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


@torch.no_grad()
def evaluate(model: FullModel, batches: Sequence[Tensor]) -> float:
    """Mean loss over int64 (B, T + 1) batches (every batch weighs the same); restores train mode."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for batch in batches:
            batch = batch.to(device)
            total += float(model.loss(batch[:, :-1], batch[:, 1:]))
    finally:
        model.train(was_training)
    return total / len(batches)


@dataclass(kw_only=True)
class LocalTrainResult:
    model: FullModel  # the trained model
    losses: list[float]  # training loss of every step, in order
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (steps done, mean val loss)
    train_time_s: float  # wall time of the optimisation steps only (evaluation excluded)
    tokens_per_s: float  # steps * batch_size * seq_len / train_time_s


def train_local(
    model_config: ModelConfig,
    data: BatchSource,
    *,
    steps: int,
    batch_size: int,
    lr: float = 3e-4,
    seed: int = 0,
    seq_len: int | None = None,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.1,
    grad_clip_norm: float | None = None,
    eval_every_steps: int | None = None,
    eval_batches: int = 4,
    device: torch.device | str = "cpu",
    on_step: Callable[[int, float], None] | None = None,
) -> LocalTrainResult:
    """Train `build_full_model(model_config)` with AdamW at constant `lr` for `steps` steps.

    Batches are `data.sample("train", batch_size, seq_len)` with a generator seeded by `seed`
    (the init comes from model_config.seed), so two calls with equal arguments give the same loss
    history up to floating-point nondeterminism of the backend. `seq_len` defaults to the config's.
    Validation (mean over `eval_batches` fixed val batches) runs every `eval_every_steps` steps and
    after the last step; `eval_batches=0` turns it off. Gradient clipping is off by default
    (`grad_clip_norm`), matching the swarm, where each stage steps on its own.
    `on_step(step, loss)` is called after every step (step counts from 1).
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    T = model_config.seq_len if seq_len is None else seq_len
    if not 1 <= T <= model_config.seq_len:
        raise ValueError(f"seq_len must be in 1..{model_config.seq_len} (the model's), got {T}")
    if eval_every_steps is not None and eval_every_steps < 1:
        raise ValueError(f"eval_every_steps must be None or >= 1, got {eval_every_steps}")

    model = build_full_model(model_config, device=device)
    model.train()
    optimizer = torch.optim.AdamW(adamw_param_groups(model, weight_decay), lr=lr, betas=betas)
    generator = torch.Generator().manual_seed(seed)
    val_set = data.val_batches(batch_size, T, eval_batches) if eval_batches > 0 else []

    losses: list[float] = []
    val_losses: list[tuple[int, float]] = []
    train_time_s = 0.0
    for step in range(1, steps + 1):
        started = time.perf_counter()
        batch = data.sample("train", batch_size, T, generator).to(device)  # (B, T + 1)
        loss = model.loss(batch[:, :-1], batch[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm)
        optimizer.step()
        value = loss.item()  # syncs the device, so the timing below is honest
        train_time_s += time.perf_counter() - started
        losses.append(value)
        if on_step is not None:
            on_step(step, value)
        due = eval_every_steps is not None and step % eval_every_steps == 0
        if val_set and (due or step == steps):
            val_losses.append((step, evaluate(model, val_set)))

    return LocalTrainResult(
        model=model,
        losses=losses,
        val_losses=val_losses,
        train_time_s=train_time_s,
        tokens_per_s=steps * batch_size * T / train_time_s,
    )
