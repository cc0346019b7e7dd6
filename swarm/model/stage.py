"""One pipeline stage of the GPT: the unit a peer serves and replicas average.

Stage 0 owns the token and position embeddings; the last stage owns the final LayerNorm, the head
and the loss; every stage owns a contiguous run of blocks (`ModelConfig.stage_layers`). With
`bottleneck_dim` set, activations cross each cut at that width through a learned pair of Linears (with
`bottleneck_tokens` also the token ids, which the stage after the cut embeds itself); with
`subspace_dim` set, every stage but the last works in the coordinates of one fixed subspace and the stages after
the first take the token ids too (swarm.model.subspace).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
from torch import Tensor, nn

from swarm.model.base import StageBase
from swarm.model.config import PRINCIPAL_INITS, AnyModelConfig, ModelConfig
from swarm.model.hfconfig import HFModelConfig
from swarm.model.layers import INIT_STD, Block, Bottleneck, init_stage_parameters, named_generator
from swarm.model.subspace import (
    SubspaceBlock,
    check_joined_tokens,
    fixed_embeddings,
    join_tokens,
    split_tokens,
    subspace_basis,
)


class Stage(StageBase):
    """Stage `index` of `config`. Build it with `build_stage`, which also initialises it.

    Input:  stage 0: int64 token ids (B, T); other stages: float (B, T, config.boundary_dim(index)), and with
            `subspace_dim` one more coordinate holding the token ids (swarm.model.subspace.join_tokens).
    Output: non-last stages: (B, T, config.boundary_dim(index + 1)); last stage: logits (B, T, vocab).
    Any 1 <= T <= config.seq_len is allowed (positions are 0..T-1); B >= 1.
    `forward` does not validate its input; a peer calls `check_input` (and `check_targets`) on
    anything that came over the wire first.
    """

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self._place(config, index)
        d = config.d_model
        if config.subspace_dim is not None:
            self._init_subspace(config)
            return
        if self.is_first:
            self.tok_emb = nn.Embedding(config.vocab_size, d)
            self.pos_emb = nn.Embedding(config.seq_len, d)
        elif config.bottleneck_dim is not None:
            self.bottleneck_in = Bottleneck(
                config.bottleneck_dim, d, cut=index - 1, scaled=config.bottleneck_init == "scaled"
            )
        self.blocks = nn.ModuleList(Block(config) for _ in config.stage_layers(index))
        if self.is_last:
            self.ln_f = nn.LayerNorm(d)
            # No weight tying: the embedding lives on stage 0, the head on the last stage.
            self.head = nn.Linear(d, config.vocab_size, bias=False)
        elif config.bottleneck_dim is not None:
            self.bottleneck_out = Bottleneck(
                d, config.bottleneck_dim, cut=index, scaled=config.bottleneck_init == "scaled"
            )
        if (
            config.bottleneck_init == "pca-frozen"
        ):  # the pair stays at its init: no gradient, no optimizer step
            for name in ("bottleneck_in", "bottleneck_out"):
                if hasattr(self, name):
                    getattr(self, name).requires_grad_(False)
        self.takes_tokens = config.takes_tokens(index)
        if self.takes_tokens:
            # registered last, so every other parameter draws the same values as without them
            self.cut_tok_emb = nn.Embedding(config.vocab_size, d)
            self.cut_pos_emb = nn.Embedding(config.seq_len, d)

    def _init_subspace(self, config: ModelConfig) -> None:
        d, k = config.d_model, config.subspace_dim
        self.takes_tokens = config.takes_tokens(self.index)
        if self.is_first:  # the learned part of the embedding, in U's coordinates
            self.tok_emb = nn.Embedding(config.vocab_size, k)
            self.pos_emb = nn.Embedding(config.seq_len, k)
        layers = config.stage_layers(self.index)
        self.blocks = nn.ModuleList(
            (Block if self.is_last else SubspaceBlock)(config) for _ in layers
        )
        if self.is_last:
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, config.vocab_size, bias=False)
        # fixed, from the seed on every peer: not parameters, not in the state dict (fill_fixed writes them)
        self.register_buffer("basis", torch.empty(d, k), persistent=False)  # U (d, k)
        self.register_buffer("fixed_tok", torch.empty(config.vocab_size, d), persistent=False)
        self.register_buffer("fixed_pos", torch.empty(config.seq_len, d), persistent=False)

    def fill_fixed(self) -> None:
        """Write the subspace cut's fixed tensors (U, E0, P0) from the seed; a no-op without the cut. Called after
        the stage gets real memory (its buffers are garbage until then)."""
        if self.config.subspace_dim is None:
            return
        token, position = fixed_embeddings(self.config)
        with torch.no_grad():
            self.basis.copy_(subspace_basis(self.config))
            self.fixed_tok.copy_(token)
            self.fixed_pos.copy_(position)

    def input_spec(self, batch_size: int, seq_len: int | None = None):
        shape, dtype = super().input_spec(batch_size, seq_len)
        if self.takes_tokens:
            shape = (*shape[:2], shape[2] + 1)  # the token ids ride in one more coordinate
        return shape, dtype

    def check_input(self, x: Tensor) -> None:
        super().check_input(x)
        if self.takes_tokens:
            check_joined_tokens(x, self.config.vocab_size, f"stage {self.index} input")

    def synthetic_input(self, batch_size: int) -> Tensor:
        x = super().synthetic_input(batch_size)
        if self.takes_tokens:  # valid ids in the last coordinate
            x[..., -1] = torch.randint(0, self.config.vocab_size, x.shape[:2]).to(x.dtype)
        return x

    def _forward_subspace(self, x: Tensor) -> Tensor:
        if self.is_first:
            ids = x  # (B, T)
            positions = torch.arange(x.shape[1], device=x.device)  # (T,)
            z = self.tok_emb(ids) + self.pos_emb(positions)  # (B, T, k)
        else:
            z, ids = split_tokens(x)  # (B, T, k), (B, T)
        base = self.fixed_tok[ids] + self.fixed_pos[: ids.shape[1]]  # (B, T, D)
        if not self.is_last:
            for block in self.blocks:
                z = block(base, z, self.basis)  # (B, T, k)
            return z
        h = base + z @ self.basis.T  # (B, T, D): the stream, exactly
        for block in self.blocks:
            h = block(h)  # (B, T, D)
        return self.head(self.ln_f(h))  # (B, T, V)

    def forward(self, x: Tensor) -> Tensor:
        if self.config.subspace_dim is not None:
            return self._forward_subspace(x)
        h = self.cut_stream(x)
        if self.is_last:
            return self.head(self.ln_f(h))  # (B, T, V)
        if self.config.bottleneck_dim is not None:
            return self.bottleneck_out(h)  # (B, T, b)
        return h

    def cut_stream(self, x: Tensor) -> Tensor:
        """The stream this stage's blocks end with, (B, T, D): what its bottleneck (if any) compresses; with
        bottleneck_tokens less the embedding this stage added (the receiver rebuilds it from the ids)."""
        # the token and position embedding this stage added to the stream, if it did
        embedded = None
        if self.is_first:
            T = x.shape[1]
            positions = torch.arange(T, device=x.device)  # (T,)
            h = embedded = self.tok_emb(x) + self.pos_emb(positions)  # (B, T, D)
        elif self.takes_tokens:  # bottleneck_tokens: the ids ride in the last coordinate
            x, ids = split_tokens(x)  # (B, T, b), (B, T)
            positions = torch.arange(x.shape[1], device=x.device)  # (T,)
            embedded = self.cut_tok_emb(ids) + self.cut_pos_emb(positions)  # (B, T, D)
            h = self.bottleneck_in(x) + embedded  # (B, T, D)
        elif self.config.bottleneck_dim is not None:
            h = self.bottleneck_in(x)  # (B, T, b) -> (B, T, D)
        else:
            h = x  # (B, T, D)
        for block in self.blocks:
            h = block(h)  # (B, T, D)
        if self.config.bottleneck_tokens and not self.is_last:
            # the receiver embeds the ids itself: the bottleneck carries only what the blocks wrote
            return h - embedded  # (B, T, D)
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
    return _build_gpt_stage(config, index).to(device)


def _build_gpt_stage(config: ModelConfig, index: int, *, principal_out: bool = True) -> Stage:
    # Build on the meta device so module constructors do not draw from (and advance) the global
    # RNG; then allocate real memory and fill every parameter from a per-stage generator on CPU.
    with torch.device("meta"):
        stage = Stage(config, index)
    stage.to_empty(device="cpu")
    generator = torch.Generator(device="cpu").manual_seed(stage_seed(config, index))
    init_stage_parameters(stage, config, generator)
    if config.bottleneck_tokens:
        _same_embedding_on_both_sides(stage, config)
    if config.bottleneck_init in PRINCIPAL_INITS:
        _principal_pair(stage, config, out=principal_out)
    stage.fill_fixed()
    return stage


def _same_embedding_on_both_sides(stage: Stage, config: ModelConfig) -> None:
    """With bottleneck_tokens, every later stage's cut embeddings start as stage 0's embeddings, which are the ones
    the same model without the cut draws (stage 0's generator draws its token, then its position table first), so
    the receiver's rebuilt embedding starts as the sender's: with an identity pair at the cut the split model
    starts as the unsplit one."""
    if stage.is_first:
        return
    generator = torch.Generator(device="cpu").manual_seed(stage_seed(config, 0))
    token = torch.empty(config.vocab_size, config.d_model)
    position = torch.empty(config.seq_len, config.d_model)
    with torch.no_grad():
        token.normal_(0.0, INIT_STD, generator=generator)
        position.normal_(0.0, INIT_STD, generator=generator)
        stage.cut_tok_emb.weight.copy_(token)
        stage.cut_pos_emb.weight.copy_(position)


# stages whose activations a principal-subspace init of a cut is computed from
CALIBRATION_BATCH = 16


@functools.lru_cache(maxsize=8)
def principal_directions(config: ModelConfig, cut: int) -> Tensor:
    """The top ``bottleneck_dim`` principal directions (d_model, b), orthonormal columns, of the stream stage
    ``cut`` hands its bottleneck at init (``Stage.cut_stream``: h, or h - e with bottleneck_tokens), on a
    calibration batch of token ids drawn from (config.seed, cut): every peer computes the same matrix from the
    config alone, without data (the embeddings are random at init, so random ids are as typical as text).
    Uncentred (the second moment), so U U^T h is the best b-dimensional approximation of h itself."""
    generator = named_generator(f"swarm-cut-calibration:{config.seed}:{cut}")
    ids = torch.randint(
        0, config.vocab_size, (CALIBRATION_BATCH, config.seq_len), generator=generator
    )
    x = ids
    with torch.no_grad():
        for index in range(cut + 1):
            # stage `cut`'s own down projection is what is being computed: leave it random
            stage = _build_gpt_stage(config, index, principal_out=index < cut)
            x = stage.cut_stream(x) if index == cut else stage(x)
            if config.bottleneck_tokens and index < cut:
                x = join_tokens(x, ids)  # the ids ride beside the values
    h = x.reshape(-1, config.d_model).double()  # (N, D)
    eigenvalues, eigenvectors = torch.linalg.eigh(h.T @ h)  # ascending
    top = eigenvectors[:, -config.bottleneck_dim :].flip(-1)  # (D, b), largest first
    # fix each column's sign (eigh's is arbitrary) so every machine's LAPACK gives the same matrix
    signs = torch.sign(top[top.abs().argmax(dim=0), torch.arange(top.shape[1])])
    return (top * signs).float()


def _principal_pair(stage: Stage, config: ModelConfig, *, out: bool = True) -> None:
    """bottleneck_init "pca"/"pca-frozen": each cut's pair starts as U^T (down) and U (up), U the cut's
    principal directions at init, so up(down(h)) is h's projection on its top-b subspace."""
    with torch.no_grad():
        if out and getattr(stage, "bottleneck_out", None) is not None:
            stage.bottleneck_out.weight.copy_(principal_directions(config, stage.index).T)
            stage.bottleneck_out.bias.zero_()
        if getattr(stage, "bottleneck_in", None) is not None:
            stage.bottleneck_in.weight.copy_(principal_directions(config, stage.index - 1))
            stage.bottleneck_in.bias.zero_()


def empty_stage(
    config: AnyModelConfig, index: int, *, device: torch.device | str = "cpu"
) -> StageBase:
    """A stage with allocated but UNINITIALISED parameters, for loading a state dict right after."""
    if isinstance(config, HFModelConfig):
        from swarm.model.hf import empty_hf_stage

        return empty_hf_stage(config, index, device=device)
    with torch.device("meta"):
        stage = Stage(config, index)
    stage.to_empty(device="cpu")
    stage.fill_fixed()  # not in a state dict: the caller loads the parameters only
    return stage.to(device)
