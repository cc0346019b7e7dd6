"""Transformer building blocks (pre-LN GPT block) and the seeded, RNG-independent initialiser."""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarm.model.config import ModelConfig

INIT_STD = 0.02  # GPT-2 weight init


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.proj.is_residual_projection = True  # read by init_stage_parameters

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)  # 3 x (B, T, D)
        # (B, T, D) -> (B, H, T, D/H)
        q, k, v = (t.view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D/H)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))  # (B, T, D)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden)
        self.proj = nn.Linear(hidden, config.d_model)
        self.proj.is_residual_projection = True

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (B, T, D) -> (B, T, 4D) -> (B, T, D)


class Block(nn.Module):
    """Pre-LN block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, D)
        return x + self.mlp(self.ln2(x))  # (B, T, D)


class Bottleneck(nn.Linear):
    """A Linear at stage cut ``cut`` (between stages cut and cut + 1): d_model -> bottleneck_dim, or back.

    ``bottleneck_init`` "random": std 1/sqrt(fan_in) rather than 0.02, so the pair of projections around a cut
    preserves activation scale at init instead of shrinking it by ~(0.02^2 * width) per projection.
    "orthogonal": the down projection is Q^T and the up projection Q for one orthonormal Q (d, b) per cut
    (``cut_projection``), so up(down(h)) starts as the orthogonal projection of h onto a b-dimensional
    subspace: each coordinate crossing the cut has the scale of h's, and stage cut + 1 starts from stage cut's
    residual stream (its part in the subspace) instead of from a random mix of it.
    """

    def __init__(
        self, in_features: int, out_features: int, *, cut: int, scaled: bool = False
    ) -> None:
        super().__init__(in_features, out_features)
        self.cut = cut
        # "scaled": the weight is stored at N(0, INIT_STD) and multiplied by this fixed gain in the forward, so the
        # effective weight starts as random's N(0, 1 / fan_in) but AdamW moves it gain times faster
        self.gain = 1.0 / (INIT_STD * math.sqrt(in_features)) if scaled else 1.0

    def forward(self, x: Tensor) -> Tensor:
        if self.gain == 1.0:
            return super().forward(x)
        return F.linear(x, self.weight * self.gain, self.bias)


def named_generator(label: str) -> torch.Generator:
    """A CPU generator seeded by a hash of ``label`` (which names the run's seed and what it draws): the same on
    every process and machine, apart from every other label's."""
    digest = hashlib.sha256(label.encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def cut_projection(config: ModelConfig, cut: int) -> Tensor:
    """The orthonormal (d_model, bottleneck_dim) matrix of cut ``cut``: the same in both stages around it (its
    seed is a hash of (config.seed, cut), apart from either stage's generator)."""
    generator = named_generator(f"swarm-cut-init:{config.seed}:{cut}")
    gaussian = torch.randn(
        config.d_model, config.bottleneck_dim, generator=generator, dtype=torch.float64
    )
    q, r = torch.linalg.qr(gaussian)  # (d, b) orthonormal columns
    # fix the signs (QR is unique up to them) so every LAPACK gives the same Q
    return (q * torch.sign(torch.diagonal(r))).float()


def _cut_generator(config: ModelConfig, cut: int, name: str) -> torch.Generator:
    """The generator of one projection of cut ``cut`` (by ``name``: down or up), apart from the stages'."""
    side = "down" if name.endswith("bottleneck_out") else "up"
    return named_generator(f"swarm-cut-pair:{config.seed}:{cut}:{side}")


def init_stage_parameters(
    module: nn.Module, config: ModelConfig, generator: torch.Generator
) -> None:
    """Fill every parameter of `module` in place from `generator` only (never the global RNG).

    GPT-2 scheme: Linear/Embedding weights ~ N(0, 0.02), residual projections ~ N(0, 0.02 /
    sqrt(2 * n_layers)), biases 0, LayerNorm weight 1. Parameters are visited in `named_modules`
    order, so the same module structure and generator state always give the same values.
    Raises TypeError for a module type with parameters this function does not know, so that no
    parameter is ever left uninitialised (stages are built on the meta device, then materialised
    with `to_empty`, whose memory is garbage until written here).
    """
    residual_std = INIT_STD / math.sqrt(2 * config.n_layers)
    with torch.no_grad():
        for name, sub in module.named_modules():
            if isinstance(sub, Bottleneck):
                # drawn from the cut's own generator, not the stage's: every other parameter of the stage is then
                # the one the same model without a bottleneck draws, so a bottleneck run differs from it only by
                # the bottleneck (and the pair is drawn under every init, so the inits differ only in the pair)
                sub.weight.normal_(
                    0.0,
                    1.0 / math.sqrt(sub.in_features),
                    generator=_cut_generator(config, sub.cut, name),
                )
                sub.weight.div_(sub.gain)  # "scaled": stored / gain, the same effective weight
                sub.bias.zero_()
                if config.bottleneck_init == "orthogonal":
                    q = cut_projection(config, sub.cut)  # (d, b)
                    # down is the stage's bottleneck_out (by name: at bottleneck_dim == d_model both shapes match)
                    sub.weight.copy_(q.T if name.endswith("bottleneck_out") else q)
            elif isinstance(sub, nn.Linear):
                std = residual_std if getattr(sub, "is_residual_projection", False) else INIT_STD
                sub.weight.normal_(0.0, std, generator=generator)
                if sub.bias is not None:
                    sub.bias.zero_()
            elif isinstance(sub, nn.Embedding):
                sub.weight.normal_(0.0, INIT_STD, generator=generator)
            elif isinstance(sub, nn.LayerNorm):
                sub.weight.fill_(1.0)
                sub.bias.zero_()
            elif any(True for _ in sub.parameters(recurse=False)):
                raise TypeError(
                    f"init_stage_parameters cannot initialise {name!r} ({type(sub).__name__})"
                )
