"""Hugging Face model families (GPT-2, Llama): the run's description of a transformers model cut into stages.

:class:`HFModelConfig` is what the run record carries for these families: the family, the transformers
configuration as a plain dict (what ``config.json`` holds), how it is cut, and the sha256 of the pretrained
weights the run started from, if any. It answers the same questions as :class:`swarm.model.ModelConfig`
(``num_stages``, ``seq_len``, ``d_model``, ``vocab_size``, ``stage_layers``, ``boundary_dim``, ...), so the
peer, trainer, rebalancer and status code need not know which family they serve.

Imports without torch or transformers: the transformers config object is built on first use.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from swarm.schema import parse_dataclass

# family -> (the config.json keys this module reads: width, depth, heads, positions, vocab), each a positive int
FAMILY_KEYS: dict[str, dict[str, str]] = {
    "gpt2": dict(
        d_model="n_embd",
        n_layers="n_layer",
        n_heads="n_head",
        max_positions="n_positions",
        vocab_size="vocab_size",
    ),
    "llama": dict(
        d_model="hidden_size",
        n_layers="num_hidden_layers",
        n_heads="num_attention_heads",
        max_positions="max_position_embeddings",
        vocab_size="vocab_size",
    ),
}
FAMILIES = tuple(FAMILY_KEYS)
# config.json keys that describe a file, not the model: left out of the run record
_FILE_KEYS = ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype")
_SHA256 = re.compile(r"[0-9a-f]{64}")
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# bound on the size of the carried config (it travels in every run record)
MAX_HF_CONFIG_BYTES = 64 << 10


@dataclass(kw_only=True, frozen=True)
class HFModelConfig:
    """A transformers GPT-2 or Llama causal LM cut into ``num_stages`` stages by layer ranges: stage 0 owns the
    embeddings, the last stage the final norm and the LM head. Tied embeddings are untied for training (stage 0
    owns the input embedding, the last stage a copy of it as its head, both starting equal)."""

    FAMILIES: ClassVar[tuple[str, ...]] = (
        FAMILIES  # the values of `family` this class reads (swarm.schema)
    )

    family: str  # "gpt2" or "llama": which transformers classes build the stages
    # the transformers configuration (what config.json holds), e.g. {"n_embd": 128, "n_layer": 4, ...}
    hf_config: dict[str, Any] = field(hash=False)
    num_stages: int = 2  # pipeline stages the layers are split over
    seq_len: int = 128  # longest training context in tokens (at most the model's position limit)
    seed: int = 0  # init seed; every replica of a stage initialises identically from (seed, stage)
    # sha256 (hex) of the pretrained weights the run starts from ("" = initialised from `seed`); every peer loads
    # them from its own --pretrained directory and checks this hash
    pretrained_sha256: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILY_KEYS:
            raise ValueError(
                f"HFModelConfig.family must be one of {', '.join(FAMILIES)}, got {self.family!r}"
            )
        if not isinstance(self.hf_config, dict) or not all(
            isinstance(k, str) for k in self.hf_config
        ):
            raise ValueError("HFModelConfig.hf_config must be a dict with string keys")
        try:
            size = len(json.dumps(self.hf_config))
        except (TypeError, ValueError) as e:
            raise ValueError(f"HFModelConfig.hf_config must be plain JSON: {e}") from None
        if size > MAX_HF_CONFIG_BYTES:
            raise ValueError(
                f"HFModelConfig.hf_config takes {size} bytes as JSON; at most {MAX_HF_CONFIG_BYTES} are allowed"
            )
        # a private copy: the caller's dict may change later, this config must not
        object.__setattr__(self, "hf_config", copy.deepcopy(self.hf_config))
        model_type = self.hf_config.get("model_type", self.family)
        if model_type != self.family:
            raise ValueError(
                f"hf_config has model_type {model_type!r} but the family is {self.family!r}"
            )
        for what, key in FAMILY_KEYS[self.family].items():
            value = self.hf_config.get(key)
            if not _is_int(value) or value < 1:
                raise ValueError(
                    f"hf_config['{key}'] ({what}) must be a positive int for a {self.family} model, got {value!r}"
                )
        for name in ("num_stages", "seq_len"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"HFModelConfig.{name} must be a positive int, got {value!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"HFModelConfig.seed must be a non-negative int, got {self.seed!r}")
        if self.pretrained_sha256 and not _SHA256.fullmatch(self.pretrained_sha256):
            raise ValueError(
                f"HFModelConfig.pretrained_sha256 must be 64 hex digits or empty, got {self.pretrained_sha256!r}"
            )
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"the width ({self.d_model}) must be divisible by the number of heads ({self.n_heads})"
            )
        if self.seq_len > self.max_positions:
            raise ValueError(
                f"seq_len ({self.seq_len}) is longer than the model's {self.max_positions} positions "
                f"(hf_config['{FAMILY_KEYS[self.family]['max_positions']}'])"
            )
        if self.num_stages > self.n_layers:
            raise ValueError(
                f"Number of stages ({self.num_stages}) cannot be greater than the number of layers "
                f"({self.n_layers}): every stage needs at least one layer"
            )

    # ---- the questions every model config answers (swarm.model.ModelConfig has the same)

    @property
    def d_model(self) -> int:
        return self._key("d_model")

    @property
    def n_layers(self) -> int:
        return self._key("n_layers")

    @property
    def n_heads(self) -> int:
        return self._key("n_heads")

    @property
    def vocab_size(self) -> int:
        return self._key("vocab_size")

    @property
    def max_positions(self) -> int:
        return self._key("max_positions")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    bottleneck_dim: ClassVar[None] = None  # activations cross cuts at full width
    bottleneck_tokens: ClassVar[bool] = False  # and without the token ids
    subspace_dim: ClassVar[None] = (
        None  # no subspace cut (swarm.model.subspace is the built-in GPT's)
    )

    def takes_tokens(self, stage: int) -> bool:
        """No stage takes the token ids beside its activation (see ModelConfig.takes_tokens)."""
        return False

    def stage_layers(self, stage: int) -> range:
        """Indices of the layers owned by ``stage``, split as :meth:`swarm.model.ModelConfig.stage_layers`
        splits blocks (the first ``n_layers % num_stages`` stages get one more)."""
        self._check_stage(stage)
        base, extra = divmod(self.n_layers, self.num_stages)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))

    def boundary_dim(self, stage: int) -> int:
        """Width of the activation entering ``stage`` (1 <= stage < num_stages): the hidden size; for
        ``stage == num_stages`` the width leaving the last stage: vocab_size (logits)."""
        if not _is_int(stage) or not 1 <= stage <= self.num_stages:
            raise ValueError(
                f"boundary_dim is defined for stages 1..{self.num_stages} (stage 0 takes token ids), got {stage!r}"
            )
        return self.vocab_size if stage == self.num_stages else self.d_model

    @property
    def tied_embeddings(self) -> bool:
        """Whether the transformers model ties its LM head to the input embedding (GPT-2 does by default)."""
        default = self.family == "gpt2"
        return bool(self.hf_config.get("tie_word_embeddings", default))

    def transformers_config(self):
        """The transformers configuration object (GPT2Config or LlamaConfig) of ``hf_config``, with SDPA attention
        (the stages run it without a mask: causal by construction)."""
        from transformers import GPT2Config, LlamaConfig

        cls = {"gpt2": GPT2Config, "llama": LlamaConfig}[self.family]
        values = {k: v for k, v in self.hf_config.items() if k != "model_type"}
        return cls(**values, attn_implementation="sdpa")

    def num_parameters(self) -> int:
        """Parameters of all stages together (the untied head counted apart from the embedding); builds the
        stages on torch's meta device, so it allocates nothing but imports torch and transformers."""
        from swarm.model.hf import empty_hf_stage

        return sum(
            p.numel()
            for k in range(self.num_stages)
            for p in empty_hf_stage(self, k, device="meta").parameters()
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field; ``from_dict(to_dict())`` round-trips exactly."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> HFModelConfig:
        """Parse untrusted data (a DHT record, a JSON file) by :func:`swarm.schema.parse_dataclass`'s rule."""
        return parse_dataclass(cls, data, what="model config", required=("family", "hf_config"))

    @classmethod
    def from_config_json(cls, path: str | Path, **fields: Any) -> HFModelConfig:
        """The config of a transformers ``config.json`` (or a directory holding one), with ``fields``
        (num_stages, seq_len, seed, pretrained_sha256). ``seq_len`` defaults to min(128, the model's positions).
        Raises ValueError naming the file when it cannot be read or is not a GPT-2 or Llama config."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read a transformers config from {file}: {e}") from None
        if not isinstance(data, dict) or data.get("model_type") not in FAMILY_KEYS:
            found = data.get("model_type") if isinstance(data, dict) else None
            raise ValueError(
                f"{file} is not a config of a supported family: model_type {found!r}, "
                f"supported: {', '.join(FAMILIES)}"
            )
        family = data["model_type"]
        hf_config = {k: v for k, v in data.items() if k not in _FILE_KEYS}
        if "seq_len" not in fields:
            positions = hf_config.get(FAMILY_KEYS[family]["max_positions"])
            fields["seq_len"] = min(128, positions) if _is_int(positions) else 128
        return cls(family=family, hf_config=hf_config, **fields)

    @classmethod
    def from_pretrained_dir(cls, directory: str | Path, **fields: Any) -> HFModelConfig:
        """The config of a transformers checkpoint directory (config.json + safetensors), with the sha256 of
        its weights, so that every peer can check it loads the same ones. ValueError when it is not one."""
        sha = pretrained_sha256(directory)
        return cls.from_config_json(directory, pretrained_sha256=sha, **fields)

    def _key(self, what: str) -> int:
        return self.hf_config[FAMILY_KEYS[self.family][what]]

    def _check_stage(self, stage: int) -> None:
        if not _is_int(stage) or not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be an int in [0, {self.num_stages}), got {stage!r}")


# ---- pretrained checkpoints (a local directory: config.json and model.safetensors, or shards with an index)


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a transformers checkpoint directory, in order. ValueError if there are none."""
    directory = Path(directory)
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read {index}: {e}") from None
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    raise ValueError(
        f"{directory} holds no {SAFETENSORS_FILE} (nor {SAFETENSORS_INDEX}): a pretrained directory is what "
        "transformers' save_pretrained writes (safetensors weights and config.json)"
    )


def pretrained_sha256(directory: str | Path) -> str:
    """sha256 (hex) of a checkpoint's weights: each safetensors file's name and bytes, in order. Cached per
    file set, sizes and modification times (a 500 MB checkpoint takes seconds to hash)."""
    files = weight_files(directory)
    stats = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _hash_files(stats)


@functools.lru_cache(maxsize=8)
def _hash_files(stats: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for path, _, _ in stats:
        h.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Dropout off: a backward recomputed on another peer must see the forward its caller saw.
_NO_DROPOUT_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _gpt2(**values: Any) -> dict[str, Any]:
    return dict(model_type="gpt2", **_NO_DROPOUT_GPT2, **values)


def _llama(**values: Any) -> dict[str, Any]:
    return dict(model_type="llama", **values)


HF_PRESETS: dict[str, HFModelConfig] = {
    # tiny configs for tests and CPU demos: byte vocabulary, 4 layers of width 128
    "gpt2-tiny": HFModelConfig(
        family="gpt2",
        hf_config=_gpt2(
            n_embd=128,
            n_layer=4,
            n_head=4,
            n_positions=128,
            vocab_size=256,
            bos_token_id=0,
            eos_token_id=0,
        ),
        seq_len=128,
    ),
    "llama-tiny": HFModelConfig(
        family="llama",
        hf_config=_llama(
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            vocab_size=256,
            bos_token_id=0,
            eos_token_id=0,
        ),
        seq_len=128,
    ),
    # GPT-2 small (124M parameters), the shape of openai-community/gpt2, initialised from the seed
    "gpt2-small": HFModelConfig(
        family="gpt2",
        hf_config=_gpt2(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257),
        seq_len=1024,
    ),
}
