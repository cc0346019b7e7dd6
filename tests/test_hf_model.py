"""Hugging Face GPT-2 and Llama stages: split-vs-transformers equivalence (logits and gradients), tied
embeddings, seeded init, pretrained loading from a checkpoint the test saves itself, and run records."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from swarm.config import RunConfig  # noqa: E402
from swarm.model import HFModelConfig, build_full_model, build_stage  # noqa: E402
from swarm.model.hf import pretrained_sha256  # noqa: E402

# Dropout as transformers' defaults have it (0.1 for GPT-2): stages run without it, the reference in eval mode.
GPT2 = HFModelConfig(
    family="gpt2",
    hf_config=dict(
        n_embd=32, n_layer=3, n_head=4, n_positions=32, vocab_size=96, initializer_range=0.05
    ),
    seq_len=16,
    seed=3,
)
LLAMA = HFModelConfig(
    family="llama",
    hf_config=dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        vocab_size=96,
        initializer_range=0.05,
    ),
    seq_len=16,
    seed=3,
)
CONFIGS = {"gpt2": GPT2, "llama": LLAMA}
# fp32 on both sides with the same kernels; only the order of a few reductions may differ
LOGITS_ATOL = 1e-5


def _tokens(config, B: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (B, config.seq_len + 1), generator=g)


def _reference(config: HFModelConfig, stages) -> torch.nn.Module:
    """The transformers model holding the stages' parameters (eval mode: no dropout)."""
    model = transformers.AutoModelForCausalLM.from_config(config.transformers_config())
    merged = {}
    for stage in stages:
        merged.update(stage.state_dict())
    missing, unexpected = model.load_state_dict(merged, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model.eval()


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_stages_in_a_row_equal_the_transformers_model_logits_and_gradients(family, num_stages):
    config = dataclasses.replace(CONFIGS[family], num_stages=num_stages)
    full = build_full_model(config)
    reference = _reference(config, full.stages)
    tokens = _tokens(config)
    x, y = tokens[:, :-1], tokens[:, 1:]

    logits = full(x)  # (B, T, V)
    expected = reference(input_ids=x).logits
    torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)

    F.cross_entropy(logits.reshape(-1, config.vocab_size), y.reshape(-1)).backward()
    loss = F.cross_entropy(expected.reshape(-1, config.vocab_size), y.reshape(-1))
    loss.backward()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    tied = config.tied_embeddings
    for stage in full.stages:
        for name, p in stage.named_parameters():
            want = ref_params[name].grad
            if tied and name in ("transformer.wte.weight", "lm_head.weight"):
                continue  # checked below: the tied gradient is split between two stages
            torch.testing.assert_close(p.grad, want, atol=1e-6, rtol=1e-4, msg=name)
    if tied:
        wte = full.stages[0].transformer.wte.weight
        head = full.stages[-1].lm_head.weight
        torch.testing.assert_close(wte, head, atol=0, rtol=0)  # untied copies start equal
        summed = wte.grad + head.grad
        torch.testing.assert_close(
            summed, ref_params["transformer.wte.weight"].grad, atol=1e-6, rtol=1e-4
        )
        # the tied gradient is really a sum of two different parts
        assert not torch.allclose(wte.grad, head.grad)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_stage_init_is_seeded_and_leaves_the_global_rng_alone(family):
    config = CONFIGS[family]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = build_stage(config, 1), build_stage(config, 1)
    assert torch.equal(torch.get_rng_state(), before)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    other = build_stage(dataclasses.replace(config, seed=4), 1)
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), other.parameters()))
    # every parameter was written: no garbage left from the uninitialised allocation
    for name, p in a.named_parameters():
        assert torch.isfinite(p).all() and p.abs().max() < 10, name


def test_stage_inputs_from_the_wire_are_checked():
    stage0, stage1 = build_stage(GPT2, 0), build_stage(GPT2, 1)
    with pytest.raises(ValueError, match=r"token ids in \[0, 96\]"):
        stage0.check_input(torch.tensor([[0, 96]]))
    with pytest.raises(ValueError, match="width 8, expected 32"):
        stage1.check_input(torch.zeros(1, 4, 8))
    with pytest.raises(ValueError, match="sequence length 17"):
        stage1.check_input(torch.zeros(1, 17, 32))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pretrained_weights_load_into_stages_and_match_the_saved_model(family, tmp_path):
    tc = CONFIGS[family].transformers_config()
    torch.manual_seed(0)
    saved = transformers.AutoModelForCausalLM.from_config(tc).eval()
    saved.save_pretrained(tmp_path)
    sha = pretrained_sha256(tmp_path)
    config = HFModelConfig.from_config_json(
        tmp_path, num_stages=2, seq_len=16, pretrained_sha256=sha
    )
    assert config.family == family and config.d_model == 32
    full = build_full_model(config, pretrained=tmp_path)
    x = _tokens(config)[:, :-1]
    torch.testing.assert_close(full(x), saved(input_ids=x).logits, atol=LOGITS_ATOL, rtol=0)

    with pytest.raises(ValueError, match="start the peer with --pretrained DIR"):
        build_stage(config, 0)
    with pytest.raises(ValueError, match="starts from its seed"):
        build_stage(CONFIGS[family], 0, pretrained=tmp_path)
    wrong = dataclasses.replace(config, pretrained_sha256="0" * 64)
    with pytest.raises(ValueError, match="give --pretrained the same checkpoint"):
        build_stage(wrong, 0, pretrained=tmp_path)
    with pytest.raises(ValueError, match="holds no model.safetensors"):
        pretrained_sha256(tmp_path / "nowhere")


def test_run_records_carry_the_family_and_its_config():
    run = RunConfig(model=dataclasses.replace(LLAMA, pretrained_sha256="ab" * 32))
    wire = run.to_dict()
    back = RunConfig.from_dict(wire)
    assert back == run and isinstance(back.model, HFModelConfig)
    assert back.fingerprint() == run.fingerprint()
    assert back.model.stage_layers(1) == range(2, 3) and back.model.boundary_dim(1) == 32
    # an old record (no family) is still the built-in GPT
    assert type(RunConfig.from_dict(RunConfig().to_dict()).model).__name__ == "ModelConfig"
    with pytest.raises(ValueError, match="family 'mamba', which this version does not know"):
        RunConfig.from_dict({**wire, "model": {**wire["model"], "family": "mamba"}})
    with pytest.raises(ValueError, match="hf_config' must be dict"):
        RunConfig.from_dict({**wire, "model": {**wire["model"], "hf_config": [1]}})
    with pytest.raises(ValueError, match=r"hf_config\['num_hidden_layers'\]"):
        HFModelConfig(family="llama", hf_config={**LLAMA.hf_config, "num_hidden_layers": 0})
    with pytest.raises(
        ValueError, match="seq_len \\(64\\) is longer than the model's 32 positions"
    ):
        dataclasses.replace(GPT2, seq_len=64)
    with pytest.raises(ValueError, match="model_type 'llama' but the family is 'gpt2'"):
        HFModelConfig(family="gpt2", hf_config={**GPT2.hf_config, "model_type": "llama"})


def _peer_run_config(tmp_path, *argv: str):
    from swarm import cli, runflags
    from swarm.argconfig import config_from_args
    from swarm.peer.config import PeerConfig

    args = cli.build_parser(("peer",)).parse_args(["peer", *argv])
    return runflags.run_config_from_args(args, config_from_args(PeerConfig, args).pretrained)


def test_peer_flags_start_hf_runs_from_a_preset_a_config_or_a_checkpoint(tmp_path):
    run = _peer_run_config(
        tmp_path, "--preset", "llama-tiny", "--num-stages", "4", "--seq-len", "64"
    )
    assert run.model.family == "llama" and run.model.num_stages == 4 and run.model.seq_len == 64
    assert _peer_run_config(tmp_path, "--run-id", "x") is None  # no model flag: join the run

    tc = GPT2.transformers_config()
    tc.save_pretrained(tmp_path)  # config.json only
    run = _peer_run_config(tmp_path, "--model-config", str(tmp_path / "config.json"))
    assert (
        run.model.family == "gpt2" and run.model.d_model == 32 and not run.model.pretrained_sha256
    )
    assert run.model.seq_len == 32  # min(128, the model's positions)

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tc).save_pretrained(tmp_path)
    run = _peer_run_config(tmp_path, "--pretrained", str(tmp_path), "--lr", "1e-4")
    assert run.model.pretrained_sha256 == pretrained_sha256(tmp_path) and run.lr == 1e-4

    with pytest.raises(ValueError, match="drop --preset"):
        _peer_run_config(tmp_path, "--pretrained", str(tmp_path), "--preset", "gpt2-tiny")
    with pytest.raises(ValueError, match="--bottleneck-dim is for the built-in GPT"):
        _peer_run_config(tmp_path, "--preset", "gpt2-tiny", "--bottleneck-dim", "8")
    with pytest.raises(ValueError, match="not a config of a supported family: model_type 'bert'"):
        (tmp_path / "bert.json").write_text('{"model_type": "bert"}')
        _peer_run_config(tmp_path, "--model-config", str(tmp_path / "bert.json"))
