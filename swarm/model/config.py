"""Model configuration: one frozen description of the GPT and of where it is cut into stages.

Every peer and trainer of a run must hold the same `ModelConfig`; it travels through the DHT as
`to_dict()` and is read back with `from_dict()`, which treats its input as untrusted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from swarm.model.hfconfig import HF_PRESETS, HFModelConfig
from swarm.schema import parse_dataclass

BOTTLENECK_INITS = ("random", "orthogonal", "scaled", "pca", "pca-frozen")
# the inits that start each cut's pair from the principal directions of its stream at init
PRINCIPAL_INITS = ("pca", "pca-frozen")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """A byte-level GPT decoder of `n_layers` pre-LN blocks, cut into `num_stages` pipeline stages."""

    # the values of a record's "family" this class reads (swarm.schema): none
    # (None, as it had no such field), "gpt-subspace" (subspace_dim set) and "gpt-bottleneck-tokens"
    # (bottleneck_tokens set); older versions refuse a record of a family they do not list
    FAMILIES: ClassVar[tuple[str | None, ...]] = (None, "gpt-subspace", "gpt-bottleneck-tokens")

    vocab_size: int = 256  # number of token ids; 256 = one token per byte
    d_model: int = 256  # width of the residual stream
    n_heads: int = 4  # attention heads per block; must divide d_model
    n_layers: int = 4  # transformer blocks in the whole model
    seq_len: int = 128  # longest context in tokens (size of the learned position table)
    num_stages: int = 2  # pipeline stages the blocks are split over
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
    # Optional learned compression at stage cuts (SWARM): the stage before a cut ends with
    # Linear(d_model -> bottleneck_dim), the stage after begins with Linear(bottleneck_dim -> d_model).
    # None = activations cross cuts at full width d_model.
    bottleneck_dim: int | None = None
    # How the bottleneck pair starts: "random" (independent Gaussians: the pair maps the residual stream to an
    # unrelated random stream) or "orthogonal" (down = Q^T, up = Q for one orthonormal Q (d_model, bottleneck_dim)
    # per cut, so the pair starts as a projection onto a subspace and stage k+1 sees stage k's stream in it;
    # measured worse than random on tiny, see docs/compression.md), or "scaled" (random's pair, stored as GPT-2's
    # N(0, 0.02) weights times a fixed gain 1 / (0.02 sqrt(fan_in)) in the forward: the same function at init,
    # but AdamW's steps, about lr per weight, move the pair as fast relative to its size as every other weight
    # instead of sqrt(fan_in) * 0.02 times slower). Older versions refuse "scaled" (an unknown init).
    # "pca": down = U^T, up = U for U (d_model, bottleneck_dim) the top principal directions of the stream the
    # cut compresses (h, or h - e with bottleneck_tokens) at init, on seeded calibration ids (swarm.model.stage.
    # principal_directions: every peer computes it from the config alone); "pca-frozen": that pair, never trained
    # (no gradient, no optimizer step). Older versions refuse both.
    bottleneck_init: str = "random"
    # With bottleneck_dim: the token ids cross each cut beside the bottleneck's values (1 byte per token for a
    # vocabulary of 256), and the stage after the cut adds its own learned token and position embeddings
    # (d_model wide) to the up projection's output. The stage before the cut sends down(h - e), e the embedding
    # it added itself: the bottleneck carries only what its blocks wrote (delta coding against what the
    # receiver rebuilds from the ids), never the token identity.
    bottleneck_tokens: bool = False
    # Optional lossless cut of protocol models (swarm.model.subspace): every block of every stage but the last
    # writes only into one fixed orthonormal (d_model, subspace_dim) subspace U, and the token embedding is a fixed
    # seeded table plus a learned part in U, so the residual stream at a cut is fixed(token ids) + U z exactly:
    # activations cross cuts as the subspace_dim coordinates z plus the token ids. None = off.
    subspace_dim: int | None = None
    seed: int = 0  # init seed; every replica of a stage initialises identically from (seed, stage)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_heads",
            "n_layers",
            "seq_len",
            "num_stages",
            "mlp_ratio",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.bottleneck_dim is not None and (
            not _is_int(self.bottleneck_dim) or self.bottleneck_dim < 1
        ):
            raise ValueError(
                f"ModelConfig.bottleneck_dim must be a positive int or None, got {self.bottleneck_dim!r}"
            )
        if self.subspace_dim is not None:
            self._check_subspace()
        if not isinstance(self.bottleneck_tokens, bool):
            raise ValueError(
                f"ModelConfig.bottleneck_tokens must be a bool, got {self.bottleneck_tokens!r}"
            )
        if self.bottleneck_tokens and self.bottleneck_dim is None:
            raise ValueError(
                "ModelConfig.bottleneck_tokens sends the token ids beside a bottleneck: set bottleneck_dim too"
            )
        if self.bottleneck_init not in BOTTLENECK_INITS:
            raise ValueError(
                f"ModelConfig.bottleneck_init must be one of {', '.join(BOTTLENECK_INITS)}, "
                f"got {self.bottleneck_init!r}"
            )
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"ModelConfig.seed must be a non-negative int, got {self.seed!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                f"the remainder is {self.d_model % self.n_heads}"
            )
        if self.num_stages > self.n_layers:
            raise ValueError(
                f"Number of stages ({self.num_stages}) cannot be greater than the number of layers "
                f"({self.n_layers}): every stage needs at least one block"
            )

    def _check_subspace(self) -> None:
        k = self.subspace_dim
        if not _is_int(k) or not 1 <= k < self.d_model:
            raise ValueError(
                f"ModelConfig.subspace_dim must be an int in [1, d_model) = [1, {self.d_model}) or None, got {k!r}"
            )
        if self.bottleneck_dim is not None:
            raise ValueError(
                f"ModelConfig.subspace_dim ({k}) and bottleneck_dim ({self.bottleneck_dim}) are two ways to "
                "compress the cut: choose one"
            )
        if self.num_stages < 2:
            raise ValueError(
                f"ModelConfig.subspace_dim ({k}) compresses activations at stage cuts, but a model of "
                f"{self.num_stages} stage has none: use num_stages >= 2 or drop subspace_dim"
            )

    @property
    def family(self) -> str | None:
        """The record's "family" (swarm.schema): "gpt-subspace" for the subspace cut, which a version that does
        not know it must refuse rather than read as the plain GPT; None (no key) for the plain GPT."""
        if self.bottleneck_tokens:
            return "gpt-bottleneck-tokens"
        return None if self.subspace_dim is None else "gpt-subspace"

    def takes_tokens(self, stage: int) -> bool:
        """Whether stage ``stage``'s input carries the token ids beside the activation (the subspace cut's
        stages after the first rebuild the fixed embedding from them; with bottleneck_tokens they embed them)."""
        return (self.subspace_dim is not None or self.bottleneck_tokens) and stage > 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def stage_layers(self, stage: int) -> range:
        """Indices of the blocks owned by `stage`.

        Blocks are split as evenly as possible; the first `n_layers % num_stages` stages get one
        extra block (e.g. 5 blocks over 2 stages -> range(0, 3), range(3, 5)).
        """
        self._check_stage(stage)
        base, extra = divmod(self.n_layers, self.num_stages)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))

    def boundary_dim(self, stage: int) -> int:
        """Width of the float activation entering `stage` (1 <= stage < num_stages).

        That is `bottleneck_dim` when compression is on, else `d_model`. Stage 0 takes int64 token
        ids, not an activation, so asking for it is a ValueError. As a convenience,
        `boundary_dim(num_stages)` is the width leaving the last stage: `vocab_size` (logits).
        """
        if not _is_int(stage) or not 1 <= stage <= self.num_stages:
            raise ValueError(
                f"boundary_dim is defined for stages 1..{self.num_stages} (stage 0 takes token ids), got {stage!r}"
            )
        if stage == self.num_stages:
            return self.vocab_size
        if self.subspace_dim is not None:
            return self.subspace_dim
        return self.d_model if self.bottleneck_dim is None else self.bottleneck_dim

    def num_parameters(self) -> int:
        """Total parameter count of the whole model (all stages), computed without building it."""
        d, hidden = self.d_model, self.mlp_ratio * self.d_model
        # ln1 + qkv + out proj + ln2 + fc + down proj (all Linear layers have biases).
        block = (
            2 * d
            + (d * 3 * d + 3 * d)
            + (d * d + d)
            + 2 * d
            + (d * hidden + hidden)
            + (hidden * d + d)
        )
        total = (
            self.vocab_size * d
            + self.seq_len * d
            + self.n_layers * block
            + 2 * d
            + d * self.vocab_size
        )
        if self.bottleneck_dim is not None:
            cuts = self.num_stages - 1
            b = self.bottleneck_dim
            total += cuts * ((d * b + b) + (b * d + d))
            if self.bottleneck_tokens:  # the token and position embeddings after each cut
                total += cuts * (self.vocab_size + self.seq_len) * d
        if self.subspace_dim is not None:
            k = self.subspace_dim
            # the learned embeddings and the blocks' output projections before the last stage are k wide, not d
            constrained = self.n_layers - len(self.stage_layers(self.num_stages - 1))
            total -= (self.vocab_size + self.seq_len) * (d - k)
            total -= constrained * ((d + 1) * (d - k) + (hidden + 1) * (d - k))
        return total

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field (and "family" for the subspace cut); `from_dict(to_dict())`
        round-trips exactly."""
        out = dataclasses.asdict(self)
        if self.family is not None:
            out["family"] = self.family
        return out

    @classmethod
    def from_dict(cls, data: Any) -> ModelConfig:
        """Parse a config from untrusted data (a DHT record, a checkpoint, a JSON file) by
        :func:`swarm.schema.parse_dataclass`'s rule: unknown fields are left out with a warning (a newer
        version may add some); ill-typed fields are a ValueError naming them; missing fields take their
        defaults; values are then checked by `__post_init__` (also ValueError).
        """
        return parse_dataclass(cls, data, what="model config")

    def _check_stage(self, stage: int) -> None:
        if not _is_int(stage) or not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be an int in [0, {self.num_stages}), got {stage!r}")


def token_id_bytes(vocab_size: int) -> int:
    """Bytes of one token id in the smallest integer dtype that holds ids below ``vocab_size`` (uint8, int16 or
    int32): what the subspace cut sends per token beside the activation."""
    return 1 if vocab_size <= 256 else 2 if vocab_size <= 2**15 else 4


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `True` layers is always a mistake (or a hostile record).
    return isinstance(value, int) and not isinstance(value, bool)


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Demo size: trains at a few thousand tokens/s on 2 CPU cores.
    "tiny": ModelConfig(d_model=128, n_heads=4, n_layers=4, seq_len=128, num_stages=2),
    "w1": ModelConfig(d_model=256, n_heads=4, n_layers=4, seq_len=128, num_stages=2),
    "w2": ModelConfig(d_model=512, n_heads=8, n_layers=4, seq_len=256, num_stages=2),
    "w3": ModelConfig(d_model=256, n_heads=4, n_layers=12, seq_len=128, num_stages=3),
}


# Any family's model config: what a run record's "model" holds (swarm.config.RunConfig.model).
AnyModelConfig = ModelConfig | HFModelConfig

# Every preset `swarm peer --preset` knows: the built-in GPT's and the Hugging Face families'.
ALL_PRESETS: dict[str, AnyModelConfig] = {**MODEL_PRESETS, **HF_PRESETS}
