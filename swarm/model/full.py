"""All stages of the model in one process: the single-process reference, export and generation."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarm.model.base import StageBase
from swarm.model.config import AnyModelConfig
from swarm.model.stage import build_stage, empty_stage


class FullModel(nn.Module):
    """`config.num_stages` stages chained. `stages[k]` has exactly the parameter names of `Stage(config, k)`."""

    def __init__(self, config: AnyModelConfig, stages: Sequence[StageBase]) -> None:
        super().__init__()
        if len(stages) != config.num_stages or any(s.index != k for k, s in enumerate(stages)):
            raise ValueError(
                f"FullModel needs stages 0..{config.num_stages - 1} in order, got indices {[s.index for s in stages]}"
            )
        self.config = config
        self.stages = nn.ModuleList(stages)
        # What each stage's output passes through before the next stage takes it (None: nothing); the reference
        # trainer's stand-in for the swarm's wire codecs (swarm.trainer.reference.CodecWire).
        self.wire: Callable[[Tensor], Tensor] | None = None

    def forward(self, tokens: Tensor) -> Tensor:
        """int64 tokens (B, T) -> logits (B, T, vocab)."""
        h = tokens
        last = len(self.stages) - 1
        for k, stage in enumerate(self.stages):
            # a stage after a subspace cut rebuilds the stream from the ids too (swarm.model.subspace)
            h = stage(stage.join_tokens(h, tokens) if stage.takes_tokens else h)
            if self.wire is not None and k < last:
                h = self.wire(h)
        return h

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy over all B*T tokens; same value as the chained stages' `Stage.loss`."""
        logits = self(tokens)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def stage_state_dicts(self) -> list[dict[str, Tensor]]:
        """One state dict per stage (cloned tensors, safe to keep while training goes on)."""
        return [
            {k: v.detach().clone() for k, v in stage.state_dict().items()} for stage in self.stages
        ]

    @classmethod
    def from_stage_states(
        cls,
        config: AnyModelConfig,
        states: Sequence[Mapping[str, Tensor]],
        *,
        device: torch.device | str = "cpu",
    ) -> FullModel:
        """Assemble a model from per-stage state dicts (e.g. one downloaded from each stage's peers).

        Raises ValueError if the number of states is not num_stages, or if a state dict has missing,
        unexpected or wrongly shaped tensors for its stage (i.e. it was trained with another config).
        """
        if len(states) != config.num_stages:
            raise ValueError(f"expected {config.num_stages} stage state dicts, got {len(states)}")
        stages = []
        for index, state in enumerate(states):
            stage = empty_stage(config, index, device=device)
            try:
                stage.load_state_dict(state, strict=True)
            except RuntimeError as exc:  # torch reports key and shape mismatches as RuntimeError
                raise ValueError(
                    f"state dict for stage {index} does not match the config: {exc}"
                ) from exc
            stages.append(stage)
        return cls(config, stages)


def build_full_model(
    config: AnyModelConfig,
    *,
    device: torch.device | str = "cpu",
    pretrained: str | Path | None = None,
) -> FullModel:
    """The whole model, with parameters identical to `build_stage(config, k)` for every stage k
    (`pretrained`: the weights directory of a Hugging Face run that started from one)."""
    return FullModel(
        config,
        [
            build_stage(config, k, device=device, pretrained=pretrained)
            for k in range(config.num_stages)
        ],
    )


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
