"""The staged GPT: config checks, stage split, split-vs-full equivalence, determinism, input checks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from swarm.model import (
    MODEL_PRESETS,
    FullModel,
    ModelConfig,
    build_full_model,
    build_stage,
    generate,
)
from swarm.optim import adamw_param_groups

# Small enough that a forward+backward takes milliseconds on 2 cores.
SMALL = ModelConfig(d_model=32, n_heads=4, n_layers=3, seq_len=16, num_stages=2, seed=7)
# Chained stages run the same float32 ops in the same order as FullModel, so results are bitwise
# equal in practice; the tolerance only leaves room for a backend that reorders reductions.
ATOL, RTOL = 1e-6, 1e-5


def _tokens(config: ModelConfig, B: int = 3, T: int | None = None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (B, (T or config.seq_len) + 1), generator=g)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(d_model=30, n_heads=4), r"d_model \(30\) must be divisible by n_heads \(4\)"),
        (
            dict(n_layers=2, num_stages=3),
            r"Number of stages \(3\) cannot be greater than the number of layers \(2\)",
        ),
        (dict(d_model=0), r"d_model must be a positive int, got 0"),
        (dict(seq_len=-5), r"seq_len must be a positive int, got -5"),
        (dict(n_layers=True), r"n_layers must be a positive int, got True"),
        (dict(bottleneck_dim=0), r"bottleneck_dim must be a positive int or None, got 0"),
        (dict(seed=-1), r"seed must be a non-negative int, got -1"),
    ],
)
def test_config_rejects_bad_values_with_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


@pytest.mark.parametrize(
    ("n_layers", "num_stages", "sizes"),
    [
        (4, 2, [2, 2]),
        (5, 2, [3, 2]),
        (7, 3, [3, 2, 2]),
        (12, 3, [4, 4, 4]),
        (3, 3, [1, 1, 1]),
        (4, 1, [4]),
    ],
)
def test_stage_layers_split_evenly_earlier_stages_get_extra(n_layers, num_stages, sizes):
    config = ModelConfig(d_model=16, n_heads=2, n_layers=n_layers, num_stages=num_stages)
    ranges = [config.stage_layers(s) for s in range(num_stages)]
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(n_layers))  # contiguous, complete, in order
    for stage in range(num_stages):
        assert len(build_stage(config, stage).blocks) == sizes[stage]
    with pytest.raises(ValueError, match=rf"stage must be an int in \[0, {num_stages}\)"):
        config.stage_layers(num_stages)


def test_boundary_dim():
    plain = ModelConfig(d_model=32, n_heads=4, n_layers=3, num_stages=3)
    squeezed = ModelConfig(d_model=32, n_heads=4, n_layers=3, num_stages=3, bottleneck_dim=8)
    assert [plain.boundary_dim(s) for s in (1, 2, 3)] == [32, 32, 256]
    assert [squeezed.boundary_dim(s) for s in (1, 2, 3)] == [8, 8, 256]
    with pytest.raises(ValueError, match="stage 0 takes token ids"):
        plain.boundary_dim(0)


def test_presets():
    tiny, w1, w2, w3 = (MODEL_PRESETS[k] for k in ("tiny", "w1", "w2", "w3"))
    assert (w1.d_model, w1.n_heads, w1.n_layers, w1.seq_len, w1.num_stages) == (256, 4, 4, 128, 2)
    assert (w2.d_model, w2.n_heads, w2.n_layers, w2.seq_len, w2.num_stages) == (512, 8, 4, 256, 2)
    assert (w3.d_model, w3.n_heads, w3.n_layers, w3.seq_len, w3.num_stages) == (256, 4, 12, 128, 3)
    assert [len(w3.stage_layers(s)) for s in range(3)] == [4, 4, 4]
    assert tiny.d_model <= 128 and tiny.num_stages == 2
    assert all(config.vocab_size == 256 for config in MODEL_PRESETS.values())
    assert sum(p.numel() for p in build_full_model(tiny).parameters()) == tiny.num_parameters()


def test_num_parameters_counts_bottlenecks():
    config = ModelConfig(d_model=32, n_heads=4, n_layers=3, num_stages=3, bottleneck_dim=8)
    assert sum(p.numel() for p in build_full_model(config).parameters()) == config.num_parameters()


def test_dict_round_trip():
    config = ModelConfig(d_model=64, n_heads=2, n_layers=5, num_stages=3, bottleneck_dim=16, seed=3)
    assert ModelConfig.from_dict(config.to_dict()) == config
    # missing fields: defaults
    assert ModelConfig.from_dict({"d_model": 64}) == ModelConfig(d_model=64)


# unknown: no excuse
@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"d_model": "64", "colour": "red"},
            r"field 'd_model' must be int, got '64'",
        ),
        ({"d_model": "64"}, r"model config field 'd_model' must be int, got '64'"),
        ({"n_layers": 4.0}, r"field 'n_layers' must be int, got 4.0"),
        ({"seq_len": False}, r"field 'seq_len' must be int, got False"),
        ({"bottleneck_dim": "none"}, r"field 'bottleneck_dim' must be int or None, got 'none'"),
        ({"d_model": 30}, r"d_model \(30\) must be divisible"),
        (["d_model", 64], r"model config must be a dict, got list"),
    ],
)
def test_from_dict_rejects_untrusted_input(data, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(data)


# ---------------------------------------------------------------- split == full


@pytest.mark.parametrize(
    "config",
    [
        SMALL,
        ModelConfig(d_model=32, n_heads=4, n_layers=3, seq_len=16, num_stages=3, seed=1),
        ModelConfig(d_model=32, n_heads=4, n_layers=4, seq_len=16, num_stages=2, bottleneck_dim=8),
        ModelConfig(d_model=32, n_heads=2, n_layers=3, seq_len=16, num_stages=3, bottleneck_dim=12),
    ],
    ids=["2stages", "3stages", "bottleneck", "bottleneck-3stages"],
)
def test_chained_stages_match_full_model_loss_and_gradients(config):
    batch = _tokens(config, B=3)
    inputs, targets = batch[:, :-1], batch[:, 1:]

    full = build_full_model(config)
    full_loss = full.loss(inputs, targets)
    full_loss.backward()

    # Pipeline as peers run it: each stage sees a detached input and sends back its input gradient.
    stages = [build_stage(config, k) for k in range(config.num_stages)]
    acts, outs = [], []
    h = inputs
    for stage in stages[:-1]:
        out = stage(h)
        outs.append(out)
        h = out.detach().requires_grad_()
        acts.append(h)
        assert h.shape == (3, config.seq_len, config.boundary_dim(stage.index + 1))
    stage_loss = stages[-1].loss(h, targets)
    stage_loss.backward()
    for out, act in zip(reversed(outs), reversed(acts), strict=True):
        out.backward(act.grad)

    torch.testing.assert_close(stage_loss, full_loss, atol=ATOL, rtol=RTOL)
    for k, stage in enumerate(stages):
        full_params = dict(full.stages[k].named_parameters())
        for name, param in stage.named_parameters():
            assert param.grad is not None, f"stage {k} {name} got no gradient"
            torch.testing.assert_close(param.grad, full_params[name].grad, atol=ATOL, rtol=RTOL)


def test_forward_accepts_shorter_sequences_and_is_causal():
    full = build_full_model(SMALL)
    tokens = _tokens(SMALL, B=2)[:, :-1]  # (2, 16)
    logits = full(tokens)
    assert logits.shape == (2, SMALL.seq_len, 256)
    short = full(tokens[:, :5])
    # the future never leaks back
    torch.testing.assert_close(short, logits[:, :5], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- init


def test_replicas_initialise_identically_regardless_of_global_rng():
    torch.manual_seed(123)
    a = build_stage(SMALL, 1)
    state = torch.get_rng_state()
    b = build_stage(SMALL, 1)
    assert torch.equal(torch.get_rng_state(), state), "build_stage must not consume the global RNG"
    torch.manual_seed(999)
    c = build_stage(SMALL, 1)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb) and torch.equal(pa, pc), name


def test_full_model_parameters_equal_separately_built_stages():
    full = build_full_model(SMALL)
    for k in range(SMALL.num_stages):
        alone = build_stage(SMALL, k).state_dict()
        together = full.stages[k].state_dict()
        assert alone.keys() == together.keys()
        assert all(torch.equal(alone[n], together[n]) for n in alone)


def test_different_seeds_and_stages_get_different_weights():
    other_seed = ModelConfig(**{**SMALL.to_dict(), "seed": SMALL.seed + 1})
    w = build_stage(SMALL, 0).blocks[0].attn.qkv.weight
    assert not torch.equal(w, build_stage(other_seed, 0).blocks[0].attn.qkv.weight)
    assert not torch.equal(w, build_stage(SMALL, 1).blocks[0].attn.qkv.weight)


def test_init_follows_gpt2_scheme():
    config = ModelConfig(d_model=256, n_heads=4, n_layers=8, num_stages=2)
    stage = build_stage(config, 0)
    block = stage.blocks[0]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.02)
    residual = 0.02 / math.sqrt(2 * config.n_layers)
    assert block.attn.proj.weight.std().item() == pytest.approx(residual, rel=0.03)
    assert block.mlp.proj.weight.std().item() == pytest.approx(residual, rel=0.03)
    assert torch.all(block.attn.qkv.bias == 0) and torch.all(block.ln1.weight == 1)
    assert stage.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert all(torch.isfinite(p).all() for p in stage.parameters())


# ---------------------------------------------------------------- input checks


@pytest.mark.parametrize(
    ("stage_index", "make", "message"),
    [
        (
            0,
            lambda: torch.zeros(2, 8, dtype=torch.int32),
            r"stage 0 input must have dtype torch.int64, got torch.int32",
        ),
        (
            0,
            lambda: torch.zeros(2, 8, 1, dtype=torch.int64),
            r"must be 2-D \(batch, seq_len\), got shape \(2, 8, 1\)",
        ),
        (0, lambda: torch.zeros(2, 17, dtype=torch.int64), r"sequence length 17; allowed is 1..16"),
        (0, lambda: torch.zeros(2, 0, dtype=torch.int64), r"sequence length 0; allowed is 1..16"),
        (0, lambda: torch.zeros(0, 8, dtype=torch.int64), r"batch size 0"),
        (
            0,
            lambda: torch.full((2, 8), 256),
            r"token ids in \[256, 256\]; they must lie in \[0, 256\)",
        ),
        (0, lambda: torch.full((2, 8), -1), r"token ids in \[-1, -1\]"),
        (0, lambda: [[1, 2]], r"must be a torch.Tensor, got list"),
        (
            1,
            lambda: torch.zeros(2, 8, 32, dtype=torch.float64),
            r"stage 1 input must have dtype torch.float32",
        ),
        (
            1,
            lambda: torch.zeros(2, 8),
            r"must be 3-D \(batch, seq_len, width\), got shape \(2, 8\)",
        ),
        (1, lambda: torch.zeros(2, 8, 31), r"width 31, expected 32 \(d_model\)"),
        (1, lambda: torch.full((2, 8, 32), float("nan")), r"NaN or infinite"),
    ],
)
def test_check_input_rejects_bad_tensors(stage_index, make, message):
    stage = build_stage(SMALL, stage_index)
    with pytest.raises(ValueError, match=message):
        stage.check_input(make())


def test_check_input_accepts_what_input_spec_describes():
    config = ModelConfig(
        d_model=32, n_heads=4, n_layers=3, seq_len=16, num_stages=3, bottleneck_dim=8
    )
    stages = [build_stage(config, k) for k in range(3)]
    assert stages[0].input_spec(4) == ((4, 16), torch.int64)
    assert stages[1].input_spec(4, seq_len=5) == ((4, 5, 8), torch.float32)
    h = torch.randint(0, 256, (4, 5))
    for stage in stages:
        stage.check_input(h)
        h = stage(h)
    assert h.shape == (4, 5, 256)
    with pytest.raises(ValueError, match=r"width 32, expected 8 \(bottleneck_dim\)"):
        stages[2].check_input(torch.zeros(4, 5, 32))


def test_targets_and_loss_only_on_last_stage():
    first, last = build_stage(SMALL, 0), build_stage(SMALL, 1)
    x = torch.zeros(2, 8, 32)
    with pytest.raises(RuntimeError, match="only the last stage"):
        first.loss(torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.int64))
    last.check_targets(x, torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"targets have shape \(2, 7\), expected \(2, 8\)"):
        last.check_targets(x, torch.zeros(2, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"targets have ids in \[0, 300\]"):
        last.check_targets(x, torch.tensor([[0] * 7 + [300]] * 2))
    with pytest.raises(ValueError, match=r"dtype torch.int64, got torch.float32"):
        last.check_targets(x, torch.zeros(2, 8))


# ---------------------------------------------------------------- export, generation, training


def test_stage_state_dicts_round_trip_and_mismatch_is_rejected():
    full = build_full_model(SMALL)
    with torch.no_grad():
        full.stages[1].head.weight.add_(1.0)  # differ from a fresh init
    states = full.stage_state_dicts()
    rebuilt = FullModel.from_stage_states(SMALL, states)
    tokens = _tokens(SMALL)[:, :-1]
    torch.testing.assert_close(rebuilt(tokens), full(tokens), atol=0, rtol=0)
    with pytest.raises(ValueError, match="expected 2 stage state dicts, got 1"):
        FullModel.from_stage_states(SMALL, states[:1])
    wider = ModelConfig(**{**SMALL.to_dict(), "d_model": 64})
    with pytest.raises(ValueError, match="state dict for stage 0 does not match the config"):
        FullModel.from_stage_states(wider, states)


def _next_byte_logits(model: FullModel, text: bytes) -> torch.Tensor:
    """The model's logits (V,) for the byte after ``text``, seeing its last ``seq_len`` bytes."""
    context = torch.tensor(list(text[-model.config.seq_len :]))[None]  # (1, T)
    with torch.no_grad():
        return model(context)[0, -1]


PROMPT = b"def f(x):"  # with 20 new bytes, longer than SMALL's seq_len: the context is cropped


def _sampled(model, seed: int, **settings) -> bytes:
    settings = {"temperature": 1.0, "top_k": 10, **settings}
    return generate(model, PROMPT, 20, generator=torch.Generator().manual_seed(seed), **settings)


def test_greedy_generation_takes_the_models_most_likely_byte_every_time():
    model = build_full_model(SMALL)
    greedy = generate(model, PROMPT, 20, temperature=0)
    assert len(greedy) == 20
    for i, byte in enumerate(greedy):
        assert byte == int(_next_byte_logits(model, PROMPT + greedy[:i]).argmax()), i
    # top_k=1 leaves only that byte to sample, whatever the temperature
    assert _sampled(model, seed=0, temperature=2.0, top_k=1) == greedy
    assert model.training  # mode restored


def test_sampled_generation_is_fixed_by_its_seed_and_draws_only_from_the_top_k():
    model = build_full_model(SMALL)
    out = _sampled(model, seed=0)
    assert _sampled(model, seed=0) == out and _sampled(model, seed=1) != out
    for i, byte in enumerate(out):
        top10 = torch.topk(_next_byte_logits(model, PROMPT + out[:i]), 10).indices.tolist()
        assert byte in top10, (i, byte, top10)
    assert generate(model, b"x", 0) == b""
    with pytest.raises(ValueError, match="non-empty bytes prompt"):
        generate(model, b"", 3)
    with pytest.raises(ValueError, match=r"top_k must be None or in 1..256, got 0"):
        generate(model, b"x", 3, top_k=0)


def test_swarm_generate_prints_the_prompt_then_the_models_continuation(tmp_path, capsys):
    from swarm import cli
    from swarm.config import RunConfig
    from swarm.coordinator.exportdir import LEGACY_FILE_FORMAT

    model = build_full_model(SMALL)
    path = tmp_path / "model.pt"  # the export file of earlier versions: still read
    export = {
        "format": LEGACY_FILE_FORMAT,
        "run": RunConfig(model=SMALL).to_dict(),
        "steps": [0, 0],
    }
    torch.save({**export, "stages": model.stage_state_dicts()}, path)

    def swarm_generate(seed: int) -> str:
        argv = ["generate", "--checkpoint", str(path), "--prompt", "def ", "--max-new-tokens"]
        assert cli.main([*argv, "12", "--top-k", "10", "--seed", str(seed)]) == 0
        return capsys.readouterr().out

    printed = swarm_generate(seed=3)
    continuation = generate(
        model, b"def ", 12, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(3)
    )
    assert printed == "def " + continuation.decode("utf-8", errors="replace") + "\n"
    assert swarm_generate(seed=3) == printed and swarm_generate(seed=4) != printed


def test_tiny_preset_overfits_a_fixed_batch():
    torch.manual_seed(0)  # only the batch below; init does not depend on it
    config = MODEL_PRESETS["tiny"]
    model = build_full_model(config)
    batch = _tokens(config, B=4, T=32)
    optimizer = torch.optim.AdamW(adamw_param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    losses = []
    for _ in range(25):
        loss = model.loss(batch[:, :-1], batch[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # uniform over bytes at init
    assert losses[-1] < 0.5 * losses[0], losses


def test_an_orthogonal_bottleneck_starts_as_a_projection_shared_by_both_sides_of_each_cut():
    random_init = ModelConfig(
        d_model=32, n_heads=4, n_layers=3, seq_len=16, num_stages=3, bottleneck_dim=8, seed=5
    )
    orthogonal = dataclasses.replace(random_init, bottleneck_init="orthogonal")
    model = build_full_model(orthogonal)
    for cut in (0, 1):
        down = model.stages[cut].bottleneck_out.weight  # (b, d)
        up = model.stages[cut + 1].bottleneck_in.weight  # (d, b)
        # down then up is the orthogonal projection onto a b-dimensional subspace: up = down^T, down up = I
        torch.testing.assert_close(up, down.T)
        torch.testing.assert_close(down @ up, torch.eye(8), atol=1e-6, rtol=0)
    # each cut has its own subspace
    assert not torch.allclose(
        model.stages[0].bottleneck_out.weight, model.stages[1].bottleneck_out.weight
    )
    # a replica building one stage alone gets the same matrices (no state shared between the stages' builds)
    torch.testing.assert_close(
        build_stage(orthogonal, 2).bottleneck_in.weight,
        model.stages[2].bottleneck_in.weight,
        rtol=0,
        atol=0,
    )
    # every other parameter is the random init's, so the two inits compare like for like
    baseline = build_full_model(random_init)
    for (name, ours), (_, theirs) in zip(model.named_parameters(), baseline.named_parameters()):
        if "bottleneck" in name and name.endswith("weight"):
            assert not torch.equal(ours, theirs), name
        else:
            assert torch.equal(ours, theirs), name
    with pytest.raises(
        ValueError,
        match="bottleneck_init must be one of random, orthogonal, scaled, pca, pca-frozen, got 'x'",
    ):
        dataclasses.replace(random_init, bottleneck_init="x")


@pytest.mark.parametrize("tokens", [False, True])
def test_a_principal_bottleneck_starts_from_the_top_directions_of_the_stream_it_compresses(tokens):
    random_init = ModelConfig(
        d_model=32,
        n_heads=4,
        n_layers=3,
        seq_len=16,
        num_stages=3,
        bottleneck_dim=8,
        bottleneck_tokens=tokens,
        seed=5,
    )
    pca = dataclasses.replace(random_init, bottleneck_init="pca")
    orthogonal = dataclasses.replace(random_init, bottleneck_init="orthogonal")
    model = build_full_model(pca)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    stream = (
        model.stages[0].cut_stream(ids).detach().reshape(-1, 32)
    )  # what cut 0's pair compresses
    for cut in (0, 1):
        down = model.stages[cut].bottleneck_out.weight  # (b, d)
        up = model.stages[cut + 1].bottleneck_in.weight  # (d, b)
        torch.testing.assert_close(up, down.T, rtol=0, atol=0)  # one matrix U on both sides
        torch.testing.assert_close(down @ up, torch.eye(8), atol=1e-5, rtol=0)  # orthonormal
        torch.testing.assert_close(model.stages[cut].bottleneck_out.bias, torch.zeros(8))
    # on data it was not computed from, U keeps more of the stream than the orthogonal init's random subspace
    # and far more than its share of the width (8 of 32 dims = 25%)
    u = model.stages[1].bottleneck_in.weight.detach()
    q = build_full_model(orthogonal).stages[1].bottleneck_in.weight.detach()
    kept = float((stream @ u).square().sum() / stream.square().sum())
    kept_random = float((stream @ q).square().sum() / stream.square().sum())
    assert kept > max(0.4, 1.5 * kept_random), (kept, kept_random)
    # a replica building one stage alone gets the same matrices, bit for bit
    torch.testing.assert_close(
        build_stage(pca, 2).bottleneck_in.weight,
        model.stages[2].bottleneck_in.weight,
        rtol=0,
        atol=0,
    )
    # every other parameter is the random init's
    baseline = build_full_model(random_init)
    for (name, ours), (_, theirs) in zip(model.named_parameters(), baseline.named_parameters()):
        if "bottleneck" not in name:
            assert torch.equal(ours, theirs), name
    # frozen: the same pair, which takes no gradient and no optimizer step
    frozen = build_full_model(dataclasses.replace(pca, bottleneck_init="pca-frozen"))
    for (name, ours), (_, theirs) in zip(frozen.named_parameters(), model.named_parameters()):
        assert torch.equal(ours, theirs), name
        assert ours.requires_grad == ("bottleneck" not in name), name
    frozen.loss(ids[:, :-1], ids[:, 1:]).backward()
    assert frozen.stages[0].bottleneck_out.weight.grad is None
    assert (
        frozen.stages[0].blocks[0].mlp.fc.weight.grad is not None
    )  # the stage before still learns
    optimized = {id(p) for group in adamw_param_groups(frozen, 0.1) for p in group["params"]}
    assert id(frozen.stages[1].bottleneck_in.weight) not in optimized
    # a version without these inits refuses the run instead of training another model
    from swarm.model import config as model_config

    saved = model_config.BOTTLENECK_INITS
    model_config.BOTTLENECK_INITS = ("random", "orthogonal", "scaled")
    try:
        for init in ("pca", "pca-frozen"):
            with pytest.raises(ValueError, match=f"got '{init}'"):
                ModelConfig.from_dict(dataclasses.replace(pca, bottleneck_init=init).to_dict())
    finally:
        model_config.BOTTLENECK_INITS = saved


def test_a_scaled_bottleneck_is_the_random_one_at_init_and_moves_gain_times_faster_under_adamw():
    random_init = ModelConfig(
        d_model=32, n_heads=4, n_layers=3, seq_len=16, num_stages=3, bottleneck_dim=8, seed=5
    )
    scaled = dataclasses.replace(random_init, bottleneck_init="scaled")
    ours, theirs = build_full_model(scaled), build_full_model(random_init)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids), theirs(ids), atol=1e-5, rtol=1e-5)  # the same function
    down, up = ours.stages[0].bottleneck_out, ours.stages[1].bottleneck_in
    assert down.gain == pytest.approx(1 / (0.02 * math.sqrt(32)))
    assert up.gain == pytest.approx(1 / (0.02 * math.sqrt(8)))
    # the stored weight has GPT-2's scale; the effective one is random's
    torch.testing.assert_close(down.weight * down.gain, theirs.stages[0].bottleneck_out.weight)
    # one AdamW step moves each stored weight by about lr: the effective weight moves gain times as far
    lr = 1e-3
    before = (down.weight * down.gain).detach().clone()
    opt = torch.optim.AdamW(ours.parameters(), lr=lr, weight_decay=0.0)
    ours.loss(ids[:, :-1], ids[:, 1:]).backward()
    opt.step()
    moved = (down.weight * down.gain - before).detach().abs()
    assert float(moved.max()) == pytest.approx(lr * down.gain, rel=0.01)
    # a version that knows only random and orthogonal refuses the run (its config check), rather than serve
    # another model
    with pytest.raises(ValueError, match="got 'scaled'"):
        from swarm.model import config as model_config

        saved = model_config.BOTTLENECK_INITS
        model_config.BOTTLENECK_INITS = ("random", "orthogonal")
        try:
            ModelConfig.from_dict(scaled.to_dict())
        finally:
            model_config.BOTTLENECK_INITS = saved
