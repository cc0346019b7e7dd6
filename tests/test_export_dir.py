"""The export directory: transformers loads GPT-2 and Llama exports with the swarm's logits; the built-in GPT
round-trips in its own format; `swarm generate` reads both."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from swarm import cli  # noqa: E402
from swarm.config import RunConfig  # noqa: E402
from swarm.coordinator.exportdir import (  # noqa: E402
    load_exported,
    read_export_dir,
    write_export_dir,
)
from swarm.model import HF_PRESETS, ModelConfig, build_full_model, generate  # noqa: E402

SMALL_GPT = ModelConfig(d_model=32, n_heads=4, n_layers=3, seq_len=16, num_stages=2, seed=7)


def _trained_states(model, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """A few AdamW steps on a random batch, so the head and the embedding have moved apart."""
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (4, 17), generator=g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model.loss(batch[:, :-1], batch[:, 1:]).backward()
        optimizer.step()
    return model.stage_state_dicts()


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_hf_export_loads_in_transformers_with_the_swarms_logits(preset, tmp_path):
    config = dataclasses.replace(HF_PRESETS[preset], num_stages=3, seq_len=16)
    run = RunConfig(model=config)
    model = build_full_model(config)
    states = _trained_states(model)
    write_export_dir(tmp_path, run, states, [3, 3, 3])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "swarm.json",
    ]

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (
        type(loaded).__name__
        == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[config.family]
    )
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        swarm_logits = model(x)
        hf_logits = loaded(input_ids=x).logits
    torch.testing.assert_close(hf_logits, swarm_logits, atol=1e-5, rtol=0)
    # trained untied: both tensors are there, and they differ
    assert not loaded.config.tie_word_embeddings
    head, embedding = loaded.get_output_embeddings().weight, loaded.get_input_embeddings().weight
    assert not torch.equal(head, embedding)

    run_back, model_back = load_exported(tmp_path)
    assert run_back == run
    torch.testing.assert_close(model_back(x), swarm_logits, atol=0, rtol=0)
    assert read_export_dir(tmp_path)[2] == [3, 3, 3]
    meta = json.loads((tmp_path / "swarm.json").read_text())
    assert meta["family"] == config.family and meta["format"] == 2


def test_builtin_gpt_exports_to_the_same_layout_and_generate_reads_it(tmp_path, capsys):
    run = RunConfig(model=SMALL_GPT)
    model = build_full_model(SMALL_GPT)
    states = _trained_states(model)
    write_export_dir(tmp_path, run, states, [3, 3])
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["model_type"] == "swarm-gpt"
    assert ModelConfig.from_dict(config_json["swarm_model"]) == SMALL_GPT
    _, back = load_exported(tmp_path)
    for got, want in zip(back.stage_state_dicts(), states):
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)

    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt", "def ", "--max-new-tokens"]
    assert cli.main([*argv, "8", "--seed", "1", "--top-k", "5", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    expected = generate(
        model, b"def ", 8, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(1)
    )
    assert printed == "def " + expected.decode("utf-8", errors="replace") + "\n"


def test_generate_reads_a_hf_export_with_a_larger_vocabulary(tmp_path, capsys):
    config = dataclasses.replace(
        HF_PRESETS["gpt2-tiny"],
        hf_config={**HF_PRESETS["gpt2-tiny"].hf_config, "vocab_size": 300},
        seq_len=16,
    )
    model = build_full_model(config)
    write_export_dir(tmp_path, RunConfig(model=config), model.stage_state_dicts(), [0, 0])
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "6"]
    assert cli.main([*argv, "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    # greedy over the byte ids only
    assert (
        printed == "ab" + generate(model, b"ab", 6, temperature=0).decode("utf-8", "replace") + "\n"
    )


def test_an_export_path_that_is_not_one_is_refused_with_its_name(tmp_path):
    with pytest.raises(ValueError, match="is not a swarm export directory"):
        load_exported(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; an export is a directory"):
        write_export_dir(tmp_path / "file", RunConfig(model=SMALL_GPT), [], [])
