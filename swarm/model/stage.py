"""One pipeline stage of the GPT: the unit a peer serves and replicas average.

Stage 0 owns the token and position embeddings; the last stage owns the final LayerNorm, the head
and the loss; every stage owns a contiguous run of blocks (`ModelConfig.stage_layers`). With
`bottleneck_dim` set, activations cross each cut at that width through a learned pair of Linears.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor, nn

from swarm.model.base import StageBase
from swarm.model.config import AnyModelConfig, ModelConfig
from swarm.model.hfconfig import HFModelConfig
from swarm.model.layers import Block, Bottleneck, init_stage_parameters


class Stage(StageBase):
    """Stage `index` of `config`. Build it with `build_stage`, which also initialises it.

    Input:  stage 0: int64 token ids (B, T); other stages: float (B, T, config.boundary_dim(index)).
    Output: non-last stages: (B, T, config.boundary_dim(index + 1)); last stage: logits (B, T, vocab).
    Any 1 <= T <= config.seq_len is allowed (positions are 0..T-1); B >= 1.
    `forward` does not validate its input; a peer calls `check_input` (and `check_targets`) on
    anything that came over the wire first.
    """

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self._place(config, index)
        d = config.d_model
        if self.is_first:
            self.tok_emb = nn.Embedding(config.vocab_size, d)
            self.pos_emb = nn.Embedding(config.seq_len, d)
        elif config.bottleneck_dim is not None:
            self.bottleneck_in = Bottleneck(config.bottleneck_dim, d, cut=index - 1)
        self.blocks = nn.ModuleList(Block(config) for _ in config.stage_layers(index))
        if self.is_last:
            self.ln_f = nn.LayerNorm(d)
            # No weight tying: the embedding lives on stage 0, the head on the last stage.
            self.head = nn.Linear(d, config.vocab_size, bias=False)
        elif config.bottleneck_dim is not None:
            self.bottleneck_out = Bottleneck(d, config.bottleneck_dim, cut=index)

    def forward(self, x: Tensor) -> Tensor:
        if self.is_first:
            T = x.shape[1]
            positions = torch.arange(T, device=x.device)  # (T,)
            h = self.tok_emb(x) + self.pos_emb(positions)  # (B, T, D)
        elif self.config.bottleneck_dim is not None:
            h = self.bottleneck_in(x)  # (B, T, b) -> (B, T, D)
        else:
            h = x  # (B, T, D)
        for block in self.blocks:
            h = block(h)  # (B, T, D)
        if self.is_last:
            return self.head(self.ln_f(h))  # (B, T, V)
        if self.config.bottleneck_dim is not None:
            return self.bottleneck_out(h)  # (B, T, b)
        return h


def stage_seed(config: ModelConfig, index: int) -> int:
    """Init seed of stage `index`: a hash of (config.seed, index), stable across processes and machines."""
    digest = hashlib.sha256(f"swarm-stage-init:{config.seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def build_stage(
    config: AnyModelConfig,
    index: int,
    *,
    device: torch.device | str = "cpu",
    pretrained: str | Path | None = None,
) -> StageBase:
    """Build and initialise stage `index` of `config`, in float32 on `device`.

    Deterministic: the parameters depend only on (config, index), never on the global torch RNG
    (which this function also leaves untouched), so every replica of a stage starts identical and
    `build_full_model(config).stages[k]` equals `build_stage(config, k)`.
    A Hugging Face family (`HFModelConfig`) builds an `HFStage` (swarm.model.hf); `pretrained` is the
    directory of the weights such a run started from (ValueError for the built-in GPT).
    """
    if isinstance(config, HFModelConfig):
        from swarm.model.hf import build_hf_stage

        return build_hf_stage(config, index, device=device, pretrained=pretrained)
    if pretrained is not None:
        raise ValueError(
            "--pretrained loads Hugging Face checkpoints; the built-in GPT starts from its seed"
        )
    # Build on the meta device so module constructors do not draw from (and advance) the global
    # RNG; then allocate real memory and fill every parameter from a per-stage generator on CPU.
    with torch.device("meta"):
        stage = Stage(config, index)
    stage.to_empty(device="cpu")
    generator = torch.Generator(device="cpu").manual_seed(stage_seed(config, index))
    init_stage_parameters(stage, config, generator)
    return stage.to(device)


def empty_stage(
    config: AnyModelConfig, index: int, *, device: torch.device | str = "cpu"
) -> StageBase:
    """A stage with allocated but UNINITIALISED parameters, for loading a state dict right after."""
    if isinstance(config, HFModelConfig):
        from swarm.model.hf import empty_hf_stage

        return empty_hf_stage(config, index, device=device)
    with torch.device("meta"):
        stage = Stage(config, index)
    return stage.to_empty(device=device)
