"""The subspace cut (``ModelConfig.subspace_dim``): activations cross stage cuts as k coordinates per token plus
the token id, and the stage after the cut rebuilds the full residual stream from them exactly.

The math. Let d = d_model, k = subspace_dim, U a fixed (d, k) matrix with orthonormal columns (U^T U = I_k), drawn
from the model seed alone (:func:`subspace_basis`), identical on every peer. Write the token embedding as a fixed
seeded table plus a learned part inside U::

    e(t, p) = E0[t] + P0[p] + U (E'[t] + P'[p])        E0 (V, d), P0 (T, d) fixed;  E' (V, k), P' (T, k) learned

and constrain each residual write of every block in every stage but the last (the attention and MLP output
projections) to U: ``W_out = U W'`` and ``b_out = U b'`` with W' (k, fan_in), b' (k,) learned. A pre-LN block adds
its writes to the stream, so by induction the residual stream r after any constrained block is::

    r = E0[t] + P0[p] + U z,   z = E'[t] + P'[p] + sum of the blocks' writes W' y + b'  (z in R^k)

The stages before the last therefore carry z (B, T, k), never r: a constrained block reads LN(r) with
r = base + U z (base = E0[t] + P0[p], rebuilt from the ids) and adds W' y + b' to z. At a cut the sender sends
z and the ids; the receiver computes base from the ids and its own copy of the fixed tables (from the seed) and
continues with the same r, bit for bit what a single process computes: the cut is lossless, and a run sends k of
d values per token (plus the id: 1 byte for a vocabulary of at most 256). The last stage's blocks are free.

Backward. z is the variable that crosses the cut, so the receiver's autograd gives dL/dz = U^T dL/dr: the
gradient sent back is k wide too, and exact (no projection is approximated; the learned embedding parts get
their true gradient through z, the fixed tables need none). The wire codec (int8, int4, ...) then quantizes z and
dL/dz like any activation; that is the scheme's only loss next to the constrained model in one process.

What it costs: the blocks before the last stage write into k of d directions (their reads, and the last stage,
stay full width), and the embedding is learned in k directions around a fixed random table. U is fixed for the
whole run (no re-orthogonalisation or subspace updates), so every peer derives it without coordination.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarm.model.config import ModelConfig, token_id_bytes
from swarm.model.layers import INIT_STD, CausalSelfAttention

# token ids travel in the smallest integer dtype that holds them; a float32 stage input holds them exactly below
_EXACT_FLOAT_IDS = 2**24


def _generator(tag: str, config: ModelConfig) -> torch.Generator:
    digest = hashlib.sha256(f"swarm-subspace-{tag}:{config.seed}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def subspace_basis(config: ModelConfig) -> Tensor:
    """U: the orthonormal (d_model, subspace_dim) float32 basis every stage of the run shares (seeded by
    config.seed only, with signs fixed, so every LAPACK gives the same U)."""
    gaussian = torch.randn(
        config.d_model,
        config.subspace_dim,
        generator=_generator("basis", config),
        dtype=torch.float64,
    )
    q, r = torch.linalg.qr(gaussian)  # (d, k)
    return (q * torch.sign(torch.diagonal(r))).float()


def fixed_embeddings(config: ModelConfig) -> tuple[Tensor, Tensor]:
    """E0 (vocab_size, d_model) and P0 (seq_len, d_model), float32 ~ N(0, 0.02): the embedding's fixed part, the
    same on every stage (seeded by config.seed only)."""
    generator = _generator("embedding", config)
    token = torch.randn(config.vocab_size, config.d_model, generator=generator) * INIT_STD
    position = torch.randn(config.seq_len, config.d_model, generator=generator) * INIT_STD
    return token, position


def token_wire_dtype(vocab_size: int) -> torch.dtype:
    """The smallest integer dtype that holds every token id (``token_id_bytes``): what the ids cross a cut in."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[token_id_bytes(vocab_size)]


class SubspaceMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden)
        self.proj = nn.Linear(hidden, config.subspace_dim)  # W', b': the write is U (W' y + b')
        self.proj.is_residual_projection = True

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (B, T, D) -> (B, T, 4D) -> (B, T, k)


class SubspaceBlock(nn.Module):
    """A pre-LN block whose residual writes lie in U: it maps the coordinates z (B, T, k) of the stream
    r = base + U z to those of the stream after the block. Parameter names are Block's."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.attn.proj = nn.Linear(config.d_model, config.subspace_dim)
        self.attn.proj.is_residual_projection = True
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = SubspaceMLP(config)

    def forward(self, base: Tensor, z: Tensor, basis: Tensor) -> Tensor:
        z = z + self.attn(self.ln1(base + z @ basis.T))  # (B, T, k)
        return z + self.mlp(self.ln2(base + z @ basis.T))  # (B, T, k)


def join_tokens(z: Tensor, tokens: Tensor) -> Tensor:
    """The input of a stage after a subspace cut: z (B, T, k) float32 and the token ids (B, T) as one float32
    (B, T, k + 1) tensor, the ids in the last coordinate (exact: ids < 2**24)."""
    return torch.cat([z, tokens.to(z.dtype).unsqueeze(-1)], dim=-1)


def split_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`join_tokens`: (z (B, T, k), int64 ids (B, T))."""
    return x[..., :-1], x[..., -1].detach().round().long()


def check_joined_tokens(x: Tensor, vocab_size: int, where: str) -> None:
    """ValueError unless the last coordinate of ``x`` holds integral token ids in [0, vocab_size)."""
    ids = x[..., -1]
    if ids.numel() == 0:
        return
    if not bool((ids == ids.round()).all()) or not 0 <= float(ids.min()) <= float(ids.max()) < min(
        vocab_size, _EXACT_FLOAT_IDS
    ):
        raise ValueError(
            f"{where} must carry token ids in [0, {vocab_size}) in its last coordinate (the subspace cut)"
        )
