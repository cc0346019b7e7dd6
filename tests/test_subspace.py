"""The subspace cut (swarm.model.subspace): the stream at a cut is rebuilt exactly from k coordinates and the token
ids, the gradient sent back is the stream's gradient in U, what crosses the wire round-trips (ids exactly, the
coordinates within the codec's bound on normal and heavy-tailed data), and the run record names the scheme so a
version that cannot serve it refuses it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.compression import get_codec
from swarm.config import RunConfig
from swarm.model import ModelConfig, build_full_model, build_stage
from swarm.model.stage import empty_stage
from swarm.model.subspace import (
    fixed_embeddings,
    join_tokens,
    split_tokens,
    subspace_basis,
    token_wire_dtype,
)

SUB = ModelConfig(
    d_model=32, n_heads=4, n_layers=3, seq_len=16, num_stages=3, subspace_dim=8, seed=5
)


def _tokens(config: ModelConfig, B: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (B, config.seq_len), generator=g)


def _explicit_stream(model, ids: torch.Tensor, upto_stage: int) -> torch.Tensor:
    """The residual stream after the blocks of stages < ``upto_stage``, computed at full width d as a plain GPT
    whose output projections are U W' (the definition the subspace cut must reproduce)."""
    config = model.config
    U = subspace_basis(config)  # (d, k)
    e0, p0 = fixed_embeddings(config)
    first = model.stages[0]
    T = ids.shape[1]
    r = e0[ids] + p0[:T] + (first.tok_emb(ids) + first.pos_emb(torch.arange(T))) @ U.T  # (B, T, d)
    for stage in model.stages[:upto_stage]:
        for block in stage.blocks:
            a = block.attn
            attn = torch.nn.functional.linear(
                _attention_mix(a, block.ln1(r)), U @ a.proj.weight, U @ a.proj.bias
            )
            r = r + attn
            m = block.mlp
            hidden = torch.nn.functional.gelu(m.fc(block.ln2(r)))
            r = r + torch.nn.functional.linear(hidden, U @ m.proj.weight, U @ m.proj.bias)
    return r


def _attention_mix(attn, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention without its output projection: (B, T, d) -> (B, T, d)."""
    B, T, D = x.shape
    q, k, v = attn.qkv(x).split(D, dim=2)
    q, k, v = (t.view(B, T, attn.n_heads, D // attn.n_heads).transpose(1, 2) for t in (q, k, v))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, D)


def test_the_stream_at_every_cut_is_rebuilt_exactly_from_k_coordinates_and_the_ids():
    model = build_full_model(SUB)
    ids = _tokens(SUB)
    U = subspace_basis(SUB)
    e0, p0 = fixed_embeddings(SUB)
    assert torch.allclose(U.T @ U, torch.eye(SUB.subspace_dim), atol=1e-6)  # orthonormal columns
    with torch.no_grad():
        z = model.stages[0](ids)  # (B, T, k): all that crosses the first cut, with the ids
        assert z.shape == (3, SUB.seq_len, SUB.subspace_dim)
        for cut in (1, 2):
            rebuilt = (
                e0[ids] + p0[: ids.shape[1]] + z @ U.T
            )  # what stage `cut` computes from the wire
            assert torch.allclose(rebuilt, _explicit_stream(model, ids, cut), atol=1e-5, rtol=1e-5)
            if cut < 2:
                z = model.stages[cut](join_tokens(z, ids))
        # the chained stages are the one-process model, bit for bit
        assert torch.equal(model.stages[2](join_tokens(z, ids)), model(ids))


def test_the_gradient_sent_back_is_the_streams_gradient_in_the_subspace():
    model = build_full_model(SUB)
    ids = _tokens(SUB)
    last = model.stages[2]
    U = subspace_basis(SUB)
    e0, p0 = fixed_embeddings(SUB)
    with torch.no_grad():
        z = model.stages[1](join_tokens(model.stages[0](ids), ids))
    targets = _tokens(SUB, seed=1)
    # what the peer does: the joined input as a leaf, the loss, the input gradient without the ids' coordinate
    leaf = join_tokens(z, ids).requires_grad_()
    last.loss(leaf, targets).backward()
    sent = last.wire_grad(leaf.grad)
    assert sent.shape == z.shape and torch.equal(
        leaf.grad[..., -1], torch.zeros_like(ids, dtype=z.dtype)
    )
    # the same loss as a function of the full stream r: U^T dL/dr is what was sent
    r = (e0[ids] + p0[: ids.shape[1]] + z @ U.T).requires_grad_()
    h = r
    for block in last.blocks:
        h = block(h)
    logits = last.head(last.ln_f(h))
    torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    ).backward()
    assert torch.allclose(sent, r.grad @ U, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("distribution", ["normal", "student_t2"])
def test_the_wire_round_trip_keeps_the_ids_exact_and_the_stream_within_the_codecs_bound(
    codec: str, distribution: str
):
    g = torch.Generator().manual_seed(0)
    k, d = SUB.subspace_dim, SUB.d_model
    if distribution == "normal":
        z = torch.randn(4, SUB.seq_len, k, generator=g)
    else:  # heavy tails: Student t with 2 degrees of freedom
        z = torch.distributions.StudentT(2.0).sample((4, SUB.seq_len, k))
    ids = _tokens(SUB, B=4)
    wire_codec = get_codec(codec)
    flat = z.reshape(-1).contiguous()
    z_back = wire_codec.decode(wire_codec.encode(flat), flat.numel(), torch.float32).view_as(z)
    wire_ids = ids.to(token_wire_dtype(SUB.vocab_size))
    assert wire_ids.dtype == torch.uint8  # one byte per token for 256 ids
    codec_raw = get_codec("none")
    ids_back = codec_raw.decode(codec_raw.encode(wire_ids.reshape(-1)), ids.numel(), torch.uint8)
    z2, ids2 = split_tokens(join_tokens(z_back, ids_back.view_as(ids)))
    assert torch.equal(ids2, ids)
    U = subspace_basis(SUB)
    error = (z2 - z) @ U.T  # the stream's error: U is an isometry, so it is the codec's error on z
    assert torch.allclose(error.norm(dim=-1), (z2 - z).norm(dim=-1), atol=1e-5)
    # per 32-value block, the error is below the codec's step: absmax / 127 (int8), absmax / 7 (int4)
    levels = {"int8": 127, "int4": 7}[codec]
    blocks = flat.view(-1, 32)
    bound = blocks.abs().amax(dim=1, keepdim=True) / levels * 1.01  # the bfloat16 scale rounds up
    assert bool(((z2.reshape(-1, 32) - blocks).abs() <= bound).all())
    assert error.shape == (4, SUB.seq_len, d)


def test_a_stage_after_the_cut_refuses_a_wrong_or_missing_token_column():
    stage = build_stage(SUB, 1)
    z = torch.randn(2, SUB.seq_len, SUB.subspace_dim)
    ids = _tokens(SUB, B=2)
    stage.check_input(join_tokens(z, ids))
    with pytest.raises(
        ValueError, match=r"width 8, expected 9 \(subspace_dim \+ 1 for the token ids\)"
    ):
        stage.check_input(z)
    bad = join_tokens(z, ids)
    bad[0, 0, -1] = 0.5
    with pytest.raises(ValueError, match=r"token ids in \[0, 256\) in its last coordinate"):
        stage.check_input(bad)
    with pytest.raises(ValueError, match="stage 1 takes the token ids with its input"):
        stage.join_tokens(z, None)
    with pytest.raises(ValueError, match="stage 0 takes no token ids"):
        build_stage(SUB, 0).join_tokens(ids, ids)
    stage.check_input(stage.synthetic_input(2))  # what a peer times itself on is valid


def test_parameters_buffers_and_state_dicts():
    model = build_full_model(SUB)
    assert sum(p.numel() for p in model.parameters()) == SUB.num_parameters()
    state = model.stages[1].state_dict()
    assert not any(
        name in state for name in ("basis", "fixed_tok", "fixed_pos")
    )  # rebuilt from the seed
    loaded = empty_stage(SUB, 1)
    loaded.load_state_dict(state)
    x = build_stage(SUB, 1).synthetic_input(2)
    with torch.no_grad():
        assert torch.equal(loaded(x), model.stages[1](x))
    # a different seed is a different subspace and fixed table
    other = dataclasses.replace(SUB, seed=6)
    assert not torch.equal(subspace_basis(other), subspace_basis(SUB))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(subspace_dim=32), r"subspace_dim must be an int in \[1, d_model\) = \[1, 32\)"),
        (dict(subspace_dim=8, bottleneck_dim=8), "choose one"),
        (dict(subspace_dim=8, num_stages=1), "has none"),
    ],
)
def test_config_checks(kwargs, message):
    base = dict(d_model=32, n_heads=4, n_layers=3, seq_len=16, num_stages=3)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**base, **kwargs})


def test_the_run_record_names_the_scheme_and_other_versions_refuse_it():
    run = RunConfig(model=dataclasses.replace(SUB, num_stages=2, n_layers=4), codec="int4")
    record = run.to_dict()
    assert record["model"]["family"] == "gpt-subspace" and record["model"]["subspace_dim"] == 8
    assert RunConfig.from_dict(record) == run
    # 8 int4 values (4.5 bytes) and a 1-byte id per token, against 32 float32 values (128 bytes)
    assert run.activation_bytes_ratio() == pytest.approx(128 / 5.5)
    assert "subspace 8 of 32 dims + token ids" in run.compression_scheme()
    # a version that knows only the plain GPT (and Hugging Face families) reads the family as unknown
    plain = {**record, "model": {**record["model"], "family": "gpt-subspace-v2"}}
    with pytest.raises(
        ValueError, match="family 'gpt-subspace-v2', which this version does not know"
    ):
        RunConfig.from_dict(plain)
    # a record whose family and fields disagree is refused, not read as the plain GPT
    lying = {**record, "model": {k: v for k, v in record["model"].items() if k != "subspace_dim"}}
    with pytest.raises(
        ValueError, match="says family 'gpt-subspace', but its fields describe family None"
    ):
        RunConfig.from_dict(lying)
    plain_gpt = RunConfig(model=dataclasses.replace(SUB, subspace_dim=None))
    assert "family" not in plain_gpt.to_dict()["model"]


def test_the_peer_flag_starts_a_subspace_run():
    from swarm import cli, runflags

    args = cli.build_parser(("peer",)).parse_args(
        ["peer", "--preset", "tiny", "--subspace-dim", "26", "--codec", "int4"]
    )
    run = runflags.run_config_from_args(args)
    assert run.model.subspace_dim == 26 and run.model.family == "gpt-subspace"
    assert run.activation_bytes_ratio() >= 32
    args = cli.build_parser(("peer",)).parse_args(
        ["peer", "--preset", "gpt2-tiny", "--subspace-dim", "8"]
    )
    with pytest.raises(ValueError, match="--subspace-dim is for the built-in GPT"):
        runflags.run_config_from_args(args)
