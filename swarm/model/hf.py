"""Stages of a Hugging Face GPT-2 or Llama model, built from transformers' own layer classes.

A stage holds the layers ``config.stage_layers(index)`` (``GPT2Block`` / ``LlamaDecoderLayer``), the first stage
the embeddings, the last the final norm and the LM head. Parameter names are the transformers model's
(``transformer.h.3.attn.c_attn.weight``, ``model.layers.2.mlp.up_proj.weight``, ``lm_head.weight``), so the
stages' state dicts merge into a ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` state dict as they are.

Tied embeddings (GPT-2's default) are untied: stage 0 owns the input embedding, the last stage its own copy as
the head, both starting equal (drawn from one generator, or read from the same checkpoint tensor). The sum of
their two gradients is the tied model's gradient; after the first step they train apart, and the export says
so (``tie_word_embeddings: false``).

Attention is causal through SDPA with no mask (every sequence is full length); dropout is off, so a backward
recomputed on another peer sees the forward its caller saw.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from swarm.errors import UsageError
from swarm.model.base import StageBase
from swarm.model.hfconfig import HFModelConfig, pretrained_sha256, weight_files

# where the transformers model keeps its layers, per family (the prefix of every non-head name)
_BASE_PREFIX = {"gpt2": "transformer", "llama": "model"}
_INPUT_EMBEDDING = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}


# The stages call transformers' layer classes directly (not through a model's forward), whose signatures and
# return values changed across major versions (4.x layers return tuples); written and tested against 5.x.
SUPPORTED_TRANSFORMERS_MAJOR = 5


@functools.cache
def require_transformers() -> None:
    """Raise UsageError (a line, exit 2 from the CLI) unless a supported transformers is installed."""
    try:
        import transformers
    except ImportError:
        raise UsageError(
            "GPT-2 and Llama stages need transformers and safetensors: pip install 'swarm[hf]'"
        ) from None
    major = int(transformers.__version__.split(".")[0])
    if major != SUPPORTED_TRANSFORMERS_MAJOR:
        raise UsageError(
            f"transformers {transformers.__version__} is installed; swarm's GPT-2 and Llama stages use the "
            f"layer classes of transformers {SUPPORTED_TRANSFORMERS_MAJOR}.x: pip install "
            f"'transformers>={SUPPORTED_TRANSFORMERS_MAJOR},<{SUPPORTED_TRANSFORMERS_MAJOR + 1}'"
        )


def _stage_transformers_config(config: HFModelConfig):
    """The transformers config the stage modules are built from: the run's, with dropout off."""
    tc = config.transformers_config()
    if config.family == "gpt2":
        tc.resid_pdrop = tc.embd_pdrop = tc.attn_pdrop = 0.0
    else:
        tc.attention_dropout = 0.0
    return tc


class HFStage(StageBase):
    """Stage ``index`` of a GPT-2 or Llama ``config``; build it with :func:`build_hf_stage`.

    Input: stage 0 int64 token ids (B, T); others float (B, T, d_model). Output: (B, T, d_model), or logits
    (B, T, vocab_size) on the last stage. 1 <= T <= config.seq_len; positions are 0..T-1.
    """

    def __init__(self, config: HFModelConfig, index: int) -> None:
        super().__init__()
        self._place(config, index)
        require_transformers()
        tc = _stage_transformers_config(config)
        self.family = config.family
        d, layers = config.d_model, config.stage_layers(index)
        base = nn.Module()  # "transformer" / "model", as in the transformers model
        if config.family == "gpt2":
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block

            if self.is_first:
                base.wte = nn.Embedding(config.vocab_size, d)
                base.wpe = nn.Embedding(tc.n_positions, d)
            base.h = nn.ModuleDict({str(i): GPT2Block(tc, layer_idx=i) for i in layers})
            if self.is_last:
                base.ln_f = nn.LayerNorm(d, eps=tc.layer_norm_epsilon)
            self.transformer = base
        else:
            from transformers.models.llama.modeling_llama import (
                LlamaDecoderLayer,
                LlamaRMSNorm,
                LlamaRotaryEmbedding,
            )

            if self.is_first:
                base.embed_tokens = nn.Embedding(config.vocab_size, d, tc.pad_token_id)
            base.layers = nn.ModuleDict(
                {str(i): LlamaDecoderLayer(tc, layer_idx=i) for i in layers}
            )
            if self.is_last:
                base.norm = LlamaRMSNorm(d, eps=tc.rms_norm_eps)
            self.model = base
            self._rotary_factory = functools.partial(LlamaRotaryEmbedding, config=tc)
            self.rotary_emb = self._rotary_factory()  # buffers only (not in the state dict)
        if self.is_last:
            self.lm_head = nn.Linear(d, config.vocab_size, bias=False)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute the buffers that are not parameters (Llama's rotary frequencies) on ``device``: after
        ``to_empty`` they hold garbage."""
        if self.family == "llama":
            with torch.device(device):
                self.rotary_emb = self._rotary_factory()

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        positions = torch.arange(T, device=x.device)  # (T,)
        if self.family == "gpt2":
            base = self.transformer
            h = base.wte(x) + base.wpe(positions) if self.is_first else x  # (B, T, D)
            for block in base.h.values():
                h = block(h)  # (B, T, D); no mask: SDPA is causal
            if self.is_last:
                h = base.ln_f(h)
        else:
            base = self.model
            h = base.embed_tokens(x) if self.is_first else x  # (B, T, D)
            position_ids = positions[None]  # (1, T)
            rotary = self.rotary_emb(
                h, position_ids=position_ids
            )  # cos, sin: (1, T, head_dim) each
            for layer in base.layers.values():
                h = layer(h, position_embeddings=rotary, position_ids=position_ids)  # (B, T, D)
            if self.is_last:
                h = base.norm(h)
        return self.lm_head(h) if self.is_last else h  # (B, T, V) or (B, T, D)


def _seed(config: HFModelConfig, what: str) -> int:
    digest = hashlib.sha256(f"swarm-hf-init:{config.seed}:{what}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_hf_parameters(stage: HFStage) -> None:
    """Fill every parameter of ``stage`` from seeded generators (never the global RNG), by transformers' scheme:
    matrices and embeddings ~ N(0, initializer_range), GPT-2's residual projections (``c_proj``) ~ N(0,
    initializer_range / sqrt(2 * n_layer)), biases 0, norms 1, an embedding's padding row 0. Stage k draws
    from a generator of (seed, k); the input embedding, and the head when it is tied to it, from one of
    (seed, "embedding"), so a tied head starts equal to the embedding. Raises TypeError for a module with
    parameters it does not know (stages are materialised with ``to_empty``: nothing may stay unwritten)."""
    from transformers.pytorch_utils import Conv1D

    config = stage.config
    std = float(config.hf_config.get("initializer_range", 0.02))
    residual_std = std / math.sqrt(2 * config.n_layers)
    generator = torch.Generator().manual_seed(_seed(config, f"stage{stage.index}"))

    def embedding_like(weight: Tensor) -> None:
        weight.normal_(
            0.0, std, generator=torch.Generator().manual_seed(_seed(config, "embedding"))
        )

    input_embedding = _INPUT_EMBEDDING[config.family].rsplit(".", 1)[0]
    with torch.no_grad():
        for name, sub in stage.named_modules():
            own = dict(sub.named_parameters(recurse=False))
            if not own:
                continue
            if name == input_embedding or (name == "lm_head" and config.tied_embeddings):
                embedding_like(sub.weight)
                if getattr(sub, "padding_idx", None) is not None:
                    sub.weight[sub.padding_idx].zero_()
            elif isinstance(sub, nn.Embedding):
                sub.weight.normal_(0.0, std, generator=generator)
            elif isinstance(sub, (nn.Linear, Conv1D)):
                residual = config.family == "gpt2" and name.endswith(".c_proj")
                sub.weight.normal_(0.0, residual_std if residual else std, generator=generator)
                if sub.bias is not None:
                    sub.bias.zero_()
            elif set(own) <= {"weight", "bias"} and type(sub).__name__ in (
                "LayerNorm",
                "LlamaRMSNorm",
            ):
                sub.weight.fill_(1.0)
                if "bias" in own:
                    sub.bias.zero_()
            else:
                raise TypeError(
                    f"init_hf_parameters cannot initialise {name!r} ({type(sub).__name__})"
                )


def empty_hf_stage(
    config: HFModelConfig, index: int, *, device: torch.device | str = "cpu"
) -> HFStage:
    """A stage with allocated but UNINITIALISED parameters (buffers are set), for loading a state dict."""
    with torch.device("meta"):
        stage = HFStage(config, index)
    stage.to_empty(device=device)
    stage.reset_buffers(device)
    return stage


def build_hf_stage(
    config: HFModelConfig,
    index: int,
    *,
    device: torch.device | str = "cpu",
    pretrained: str | Path | None = None,
) -> HFStage:
    """Stage ``index`` of ``config`` in float32 on ``device``: from the run's seed, or, when the run started from
    pretrained weights (``config.pretrained_sha256``), from the directory ``pretrained`` holding them.

    Raises ValueError when the run needs pretrained weights and ``pretrained`` is None, when the directory's
    weights do not hash to ``config.pretrained_sha256``, when a run from its seed is given a directory, or when
    the checkpoint lacks a tensor of the stage or holds one of another shape."""
    stage = empty_hf_stage(config, index, device="cpu")
    if config.pretrained_sha256:
        if pretrained is None:
            raise ValueError(
                f"the run continues pretrained {config.family} weights (sha256 {config.pretrained_sha256[:16]}…): "
                "start the peer with --pretrained DIR, a directory holding them (config.json + safetensors)"
            )
        load_pretrained_into(stage, pretrained)
    elif pretrained is not None:
        raise ValueError(
            f"--pretrained {pretrained} given, but the run starts from its seed (it was published without "
            "pretrained weights); drop --pretrained to join it, or start a new --run-id from the directory"
        )
    else:
        init_hf_parameters(stage)
    return stage.to(device)


# ---- pretrained checkpoints (a local directory: config.json and model.safetensors, or shards with an index)


def _checkpoint_tensors(directory: Path) -> Iterator[tuple[str, Path]]:
    """(name, file holding it) for every tensor of the checkpoint."""
    from safetensors import safe_open

    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                yield key, file


def load_pretrained_into(stage: HFStage, directory: str | Path) -> None:
    """Copy the stage's tensors from a transformers checkpoint, after checking its hash against the run's.

    Names are matched as transformers saves them (``transformer.h.0.…``), or without the base prefix as older
    GPT-2 checkpoints store them (``h.0.…``); a tied checkpoint without ``lm_head.weight`` gives the head the
    input embedding. Tensors are cast to the stage's dtype."""
    from safetensors import safe_open

    config = stage.config
    directory = Path(directory)
    got = pretrained_sha256(directory)
    if got != config.pretrained_sha256:
        raise ValueError(
            f"the weights in {directory} hash to sha256 {got[:16]}…, but the run started from "
            f"{config.pretrained_sha256[:16]}…: give --pretrained the same checkpoint the run was started from"
        )
    where = dict(_checkpoint_tensors(directory))
    prefix = _BASE_PREFIX[config.family] + "."
    state = stage.state_dict()
    with torch.no_grad():
        for name, target in state.items():
            candidates = [name, name.removeprefix(prefix)]
            if name == "lm_head.weight" and config.tied_embeddings:
                embedding = _INPUT_EMBEDDING[config.family]
                candidates += [embedding, embedding.removeprefix(prefix)]
            key = next((c for c in candidates if c in where), None)
            if key is None:
                raise ValueError(
                    f"the checkpoint in {directory} has no tensor for {name!r} (stage {stage.index})"
                )
            with safe_open(str(where[key]), framework="pt") as handle:
                tensor = handle.get_tensor(key)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"the checkpoint's {key!r} has shape {tuple(tensor.shape)}, the stage's {name!r} "
                    f"{tuple(target.shape)}: is config.json the one of these weights?"
                )
            target.copy_(tensor.to(target.dtype))
