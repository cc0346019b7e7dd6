"""The export directory ``swarm export`` writes and ``swarm generate`` reads.

Layout (what transformers' ``save_pretrained`` writes, plus the run's metadata)::

    model.safetensors   the parameters
    config.json         the model's configuration
    swarm.json          {"format": 2, "family", "run": RunConfig.to_dict(), "steps": [step of each stage]}
    tokenizer.json ...  the tokenizer the run was trained with, when ``swarm export --tokenizer DIR`` names one
                        (``swarm generate`` then uses it; without it, text is bytes)

For a Hugging Face family (GPT-2, Llama) the tensor names and ``config.json`` are transformers': the directory
loads with ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``. The head was trained apart from the input
embedding (see swarm.model.hf), so the config says ``tie_word_embeddings: false`` and both are written. The
built-in GPT uses the same layout in its own format: tensors ``stages.K.NAME`` (``FullModel``'s names) and a
``config.json`` of ``{"model_type": "swarm-gpt", "swarm_model": ModelConfig.to_dict()}``.

The export of earlier versions, one ``torch.save`` file, is still read by :func:`load_exported`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from swarm.config import RunConfig
from swarm.durable import load_tensors
from swarm.model import FullModel, HFModelConfig

EXPORT_DIR_FORMAT = 2
LEGACY_FILE_FORMAT = 1  # one torch.save dict: {"format": 1, "run", "stages", "steps"}
SWARM_JSON = "swarm.json"
CONFIG_JSON = "config.json"
WEIGHTS = "model.safetensors"
BUILTIN_MODEL_TYPE = "swarm-gpt"


def family_of(run: RunConfig) -> str:
    return run.model.family if isinstance(run.model, HFModelConfig) else "gpt"


def model_tensors(
    run: RunConfig, states: Sequence[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The flat, named tensors of the export: transformers' names for a Hugging Face family (the stages already
    use them; their layer indices are global), ``stages.K.NAME`` for the built-in GPT."""
    flat: dict[str, torch.Tensor] = {}
    hf = isinstance(run.model, HFModelConfig)
    for k, state in enumerate(states):
        for name, tensor in state.items():
            key = name if hf else f"stages.{k}.{name}"
            if key in flat:
                raise ValueError(f"stages {k} and an earlier one both hold {key!r}")
            flat[key] = tensor.detach().to("cpu", torch.float32).contiguous().clone()
    return flat


def model_config_json(run: RunConfig) -> dict:
    """``config.json``'s content: transformers' own for a Hugging Face family, swarm's for the built-in GPT."""
    if not isinstance(run.model, HFModelConfig):
        return {"model_type": BUILTIN_MODEL_TYPE, "swarm_model": run.model.to_dict()}
    tc = run.model.transformers_config()
    tc.tie_word_embeddings = False  # trained untied: the head is its own tensor
    tc.architectures = [{"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[run.model.family]]
    out = tc.to_dict()
    out.pop("_attn_implementation", None)  # how swarm computed attention, not part of the model
    out.pop("attn_implementation", None)
    out["dtype"] = "float32"
    return out


def write_export_dir(
    out: str | Path,
    run: RunConfig,
    states: Sequence[dict[str, torch.Tensor]],
    steps: Sequence[int],
    *,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write the export of ``run`` (one state dict per stage, trained to ``steps``) into directory ``out``
    (created if needed; the three files are each replaced atomically), with the files of the tokenizer
    directory ``tokenizer`` when given (its vocabulary must be the model's). Returns the directory."""
    from safetensors.torch import save_file

    from swarm.data.tokenizer import HFTokenizer, check_vocab

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; an export is a directory (give a new path)")
    tok = None
    if tokenizer is not None:
        tok = HFTokenizer.load(tokenizer)
        check_vocab(tok, run.model.vocab_size)
    FullModel.from_stage_states(run.model, states)  # refuse to write something that does not load
    out.mkdir(parents=True, exist_ok=True)
    tensors = model_tensors(run, states)
    tmp = out / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS)
    meta = {
        "format": EXPORT_DIR_FORMAT,
        "family": family_of(run),
        "run": run.to_dict(),
        "steps": list(steps),
    }
    for name, content in ((CONFIG_JSON, model_config_json(run)), (SWARM_JSON, meta)):
        tmp = out / (name + ".tmp")
        tmp.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out / name)
    if tok is not None:
        tok.copy_to(out)
    return out


def load_exported(path: str | Path) -> tuple[RunConfig, FullModel]:
    """The run config and the assembled model of an export directory (or of an earlier version's export file).
    ValueError, naming the path, when it is neither."""
    path = Path(path)
    if path.is_dir():
        return _load_dir(path)
    try:
        blob = load_tensors(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} as a swarm export: {e}") from None
    if not isinstance(blob, dict) or blob.get("format") != LEGACY_FILE_FORMAT:
        raise ValueError(f"{path} is not a swarm export; make one with `swarm export`")
    run = RunConfig.from_dict(blob["run"])
    return run, FullModel.from_stage_states(run.model, blob["stages"])


def _load_dir(path: Path) -> tuple[RunConfig, FullModel]:
    run, states, _ = read_export_dir(path)
    return run, FullModel.from_stage_states(run.model, states)


def read_export_dir(path: str | Path) -> tuple[RunConfig, list[dict[str, torch.Tensor]], list[int]]:
    """The run, each stage's state dict (the names its stage module uses) and each stage's optimizer step, as
    written by :func:`write_export_dir`. ValueError naming the path when it is not such a directory."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        meta = json.loads((path / SWARM_JSON).read_text())
        tensors = load_file(str(path / WEIGHTS))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{path} is not a swarm export directory ({e}); make one with `swarm export`"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_DIR_FORMAT:
        raise ValueError(f"{path / SWARM_JSON} is not of export format {EXPORT_DIR_FORMAT}")
    run = RunConfig.from_dict(meta.get("run"))
    states = []
    for k in range(run.model.num_stages):
        if isinstance(run.model, HFModelConfig):
            # the stage's own names: an empty stage on the meta device says which they are
            from swarm.model.hf import empty_hf_stage

            names = empty_hf_stage(run.model, k, device="meta").state_dict().keys()
            states.append({n: tensors[n] for n in names if n in tensors})
        else:
            prefix = f"stages.{k}."
            states.append(
                {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}
            )
    steps = meta.get("steps")
    if not isinstance(steps, list) or not all(isinstance(x, int) for x in steps):
        raise ValueError(f"{path / SWARM_JSON} has no list of steps")
    return run, states, steps
