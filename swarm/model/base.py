"""What every pipeline stage module offers a peer, whatever the model family: its place in the pipeline, the
shapes it takes and gives, checks of inputs from the wire, and the loss on the last stage.

A stage subclass sets ``config`` (a model config: ``num_stages``, ``seq_len``, ``vocab_size``, ``boundary_dim``,
``bottleneck_dim``), ``index``, ``is_first`` and ``is_last`` through :meth:`StageBase._place`, and defines
``forward``: stage 0 maps int64 token ids (B, T) to (B, T, output_width); later stages map float (B, T,
input_width) to the same; the last stage returns logits (B, T, vocab_size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarm.compression.base import all_finite


class StageBase(nn.Module):
    """Stage ``index`` of ``config``: the interface of swarm.model.Stage (built-in GPT) and HFStage (GPT-2,
    Llama). ``forward`` does not validate its input; a peer calls ``check_input`` (and ``check_targets``) on
    anything that came over the wire first."""

    # whether the input carries the token ids in one more coordinate (the subspace cut, swarm.model.subspace)
    takes_tokens = False

    def _place(self, config, index: int) -> None:
        config._check_stage(index)
        self.config = config
        self.index = index
        self.is_first = index == 0
        self.is_last = index == config.num_stages - 1

    @property
    def input_width(self) -> int | None:
        """Width of the float input, or None for stage 0 (token ids)."""
        return None if self.is_first else self.config.boundary_dim(self.index)

    @property
    def output_width(self) -> int:
        """Last dimension of the output: the next stage's boundary width, or vocab_size (logits)."""
        return self.config.boundary_dim(self.index + 1)

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
        if x.shape[2] != expected_shape[2]:
            what = next(
                (
                    name
                    for name in ("subspace_dim", "bottleneck_dim")
                    if getattr(self.config, name, None) is not None
                ),
                "d_model",
            )
            ids = " + 1 for the token ids" if self.takes_tokens else ""
            raise ValueError(
                f"{where} has width {x.shape[2]}, expected {expected_shape[2]} ({what}{ids})"
            )
        if not all_finite(x):  # a sum, ~30x faster than isfinite().all() (22 ms per 25 MB input)
            raise ValueError(f"{where} contains NaN or infinite values")

    def synthetic_input(self, batch_size: int) -> Tensor:
        """A valid random input of ``batch_size`` full-length sequences (for timing the stage)."""
        shape, dtype = self.input_spec(batch_size)
        if dtype == torch.int64:
            return torch.randint(0, self.config.vocab_size, shape)
        return torch.randn(shape, dtype=dtype)

    def join_tokens(self, x: Tensor, tokens: Tensor | None) -> Tensor:
        """The ``forward`` input from what crossed the wire: the activation ``x`` and, for a stage that takes them,
        the token ids (B, T) of any integer dtype. ValueError when the ids are missing or not wanted."""
        if (tokens is not None) != self.takes_tokens:
            raise ValueError(
                f"stage {self.index} takes the token ids with its input"
                if self.takes_tokens
                else f"stage {self.index} takes no token ids with its input"
            )
        if tokens is None:
            return x
        if tokens.shape != x.shape[:2] or tokens.is_floating_point():
            raise ValueError(
                f"stage {self.index} token ids must be integers of shape {list(x.shape[:2])}, got "
                f"{tokens.dtype} of shape {list(tokens.shape)}"
            )
        from swarm.model.subspace import join_tokens

        return join_tokens(x, tokens)

    def wire_grad(self, grad_input: Tensor | None) -> Tensor | None:
        """The input gradient to send back: without the token ids' coordinate (always zero) when the stage takes
        them."""
        if grad_input is None or not self.takes_tokens:
            return grad_input
        return grad_input[..., :-1].contiguous()

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
