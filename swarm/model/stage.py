"""One pipeline stage of the GPT: the unit a peer serves and replicas average.

Stage 0 owns the token and position embeddings; the last stage owns the final LayerNorm, the head
and the loss; every stage owns a contiguous run of blocks (`ModelConfig.stage_layers`). With
`bottleneck_dim` set, activations cross each cut at that width through a learned pair of Linears.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarm.model.config import ModelConfig
from swarm.model.layers import Block, Bottleneck, init_stage_parameters


class Stage(nn.Module):
    """Stage `index` of `config`. Build it with `build_stage`, which also initialises it.

    Input:  stage 0: int64 token ids (B, T); other stages: float (B, T, config.boundary_dim(index)).
    Output: non-last stages: (B, T, config.boundary_dim(index + 1)); last stage: logits (B, T, vocab).
    Any 1 <= T <= config.seq_len is allowed (positions are 0..T-1); B >= 1.
    `forward` does not validate its input; a peer calls `check_input` (and `check_targets`) on
    anything that came over the wire first.
    """

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        config._check_stage(index)
        self.config = config
        self.index = index
        self.is_first = index == 0
        self.is_last = index == config.num_stages - 1
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

    @property
    def input_width(self) -> int | None:
        """Width of the float input, or None for stage 0 (token ids)."""
        return None if self.is_first else self.config.boundary_dim(self.index)

    @property
    def output_width(self) -> int:
        """Last dimension of the output: the next stage's boundary width, or vocab_size (logits)."""
        return self.config.boundary_dim(self.index + 1)

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

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """Last stage only: forward, then mean cross-entropy over all B*T tokens (a scalar)."""
        if not self.is_last:
            raise RuntimeError(
                f"Stage.loss called on stage {self.index}, but only the last stage "
                f"({self.config.num_stages - 1}) owns the head and the loss"
            )
        logits = self(x)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def input_spec(
        self, batch_size: int, seq_len: int | None = None
    ) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype `forward` expects for `batch_size` sequences of `seq_len` tokens.

        `seq_len` defaults to config.seq_len, the longest allowed; any 1 <= T <= seq_len is valid.
        Stage 0: ((B, T), torch.int64); others: ((B, T, boundary_dim(index)), parameter dtype).
        """
        T = self.config.seq_len if seq_len is None else seq_len
        if self.is_first:
            return (batch_size, T), torch.int64
        return (batch_size, T, self.input_width), self._param_dtype()

    def check_input(self, x: Tensor) -> None:
        """Raise ValueError with a sentence if `x` is not a valid `forward` input for this stage.

        Checks type, dtype, rank, B >= 1, 1 <= T <= seq_len, width, and for stage 0 that every id
        lies in [0, vocab_size); for other stages that every value is finite (a NaN from one bad
        microbatch would otherwise poison the averaged gradients of every replica).
        """
        where = f"stage {self.index} input"
        if not isinstance(x, Tensor):
            raise ValueError(f"{where} must be a torch.Tensor, got {type(x).__name__}")
        expected_shape, expected_dtype = self.input_spec(batch_size=1)
        rank = len(expected_shape)
        if x.dtype != expected_dtype:
            raise ValueError(f"{where} must have dtype {expected_dtype}, got {x.dtype}")
        if x.dim() != rank:
            layout = "(batch, seq_len)" if self.is_first else "(batch, seq_len, width)"
            raise ValueError(f"{where} must be {rank}-D {layout}, got shape {tuple(x.shape)}")
        B, T = x.shape[0], x.shape[1]
        if B < 1:
            raise ValueError(f"{where} has batch size {B}; need at least 1 sequence")
        if not 1 <= T <= self.config.seq_len:
            raise ValueError(
                f"{where} has sequence length {T}; allowed is 1..{self.config.seq_len} (seq_len)"
            )
        if self.is_first:
            low, high = int(x.min()), int(x.max())
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(
                    f"{where} has token ids in [{low}, {high}]; they must lie in [0, {self.config.vocab_size})"
                )
            return
        if x.shape[2] != self.input_width:
            raise ValueError(
                f"{where} has width {x.shape[2]}, expected {self.input_width} "
                f"({'bottleneck_dim' if self.config.bottleneck_dim is not None else 'd_model'})"
            )
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{where} contains NaN or infinite values")

    def check_targets(self, x: Tensor, targets: Tensor) -> None:
        """Last stage: raise ValueError unless `targets` is int64 (B, T) matching `x`, ids in [0, vocab)."""
        if not isinstance(targets, Tensor):
            raise ValueError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
        if targets.dtype != torch.int64:
            raise ValueError(f"targets must have dtype torch.int64, got {targets.dtype}")
        if tuple(targets.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"targets have shape {tuple(targets.shape)}, expected {tuple(x.shape[:2])} "
                "(batch, seq_len of the input)"
            )
        if targets.numel() > 0:
            low, high = int(targets.min()), int(targets.max())
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(
                    f"targets have ids in [{low}, {high}]; they must lie in [0, {self.config.vocab_size})"
                )

    def _param_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


def stage_seed(config: ModelConfig, index: int) -> int:
    """Init seed of stage `index`: a hash of (config.seed, index), stable across processes and machines."""
    digest = hashlib.sha256(f"swarm-stage-init:{config.seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def build_stage(config: ModelConfig, index: int, *, device: torch.device | str = "cpu") -> Stage:
    """Build and initialise stage `index` of `config`, in float32 on `device`.

    Deterministic: the parameters depend only on (config, index), never on the global torch RNG
    (which this function also leaves untouched), so every replica of a stage starts identical and
    `build_full_model(config).stages[k]` equals `build_stage(config, k)`.
    """
    # Build on the meta device so module constructors do not draw from (and advance) the global
    # RNG; then allocate real memory and fill every parameter from a per-stage generator on CPU.
    with torch.device("meta"):
        stage = Stage(config, index)
    stage.to_empty(device="cpu")
    generator = torch.Generator(device="cpu").manual_seed(stage_seed(config, index))
    init_stage_parameters(stage, config, generator)
    return stage.to(device)


def empty_stage(config: ModelConfig, index: int, *, device: torch.device | str = "cpu") -> Stage:
    """A stage with allocated but UNINITIALISED parameters, for loading a state dict right after."""
    with torch.device("meta"):
        stage = Stage(config, index)
    return stage.to_empty(device=device)
