"""The bottleneck with the token ids beside it (ModelConfig.bottleneck_tokens, ``--bottleneck-tokens``): the stage
after a cut embeds the ids itself, so the model split over peers is the model in one process, the ids cross the
wire exactly and the values within the codec's bound, and the run record names the scheme so a version that cannot
serve it refuses it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.compression import get_codec
from swarm.config import RunConfig
from swarm.model import ModelConfig, build_full_model, build_stage
from swarm.model.subspace import join_tokens, split_tokens, token_wire_dtype

TOK = ModelConfig(
    d_model=32,
    n_heads=4,
    n_layers=3,
    seq_len=16,
    num_stages=3,
    bottleneck_dim=6,
    bottleneck_tokens=True,
    seed=5,
)


def _tokens(config: ModelConfig, B: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (B, config.seq_len), generator=g)


def test_the_stages_over_the_wire_compute_the_model_in_one_process_outputs_and_gradients():
    model = build_full_model(TOK)
    ids = _tokens(TOK)
    targets = _tokens(TOK, seed=1)
    # (B, T, V): build_full_model gives every stage after a cut the ids
    reference = model(ids)
    loss = torch.nn.functional.cross_entropy(
        reference.reshape(-1, TOK.vocab_size), targets.reshape(-1)
    )
    loss.backward()
    # the same forward and backward, one stage at a time, with only (b values + the id) per token between them
    stages = [build_stage(TOK, i) for i in range(TOK.num_stages)]
    h = stages[0](ids)
    assert h.shape == (3, TOK.seq_len, TOK.bottleneck_dim)
    sent = []
    for stage in stages[1:]:
        x = stage.join_tokens(h.detach(), ids.to(token_wire_dtype(TOK.vocab_size)))
        stage.check_input(x)
        x.requires_grad_()
        sent.append((h, x))
        h = stage(x)
    assert torch.allclose(h, reference, atol=1e-5)
    torch.nn.functional.cross_entropy(h.reshape(-1, TOK.vocab_size), targets.reshape(-1)).backward()
    for (before, x), stage in reversed(list(zip(sent, stages[1:]))):
        grad = stage.wire_grad(x.grad)  # the ids' coordinate is not sent back
        assert grad.shape == before.shape
        before.backward(grad)
    for k, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            q = dict(model.stages[k].named_parameters())[name]
            assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), (k, name)
    # the stages after the cuts own a d_model-wide token and position embedding each, and their gradients
    assert stages[1].cut_tok_emb.weight.grad.abs().sum() > 0
    assert not hasattr(stages[0], "cut_tok_emb")
    assert sum(p.numel() for p in model.parameters()) == TOK.num_parameters()


def test_the_token_identity_reaches_the_stage_after_the_cut_without_the_bottleneck():
    """With the bottleneck's values all zero the stage after the cut still tells tokens apart: it embeds the ids
    itself (a plain bottleneck's receiver sees the same input for every token then)."""
    stage = build_stage(TOK, TOK.num_stages - 1)
    zeros = torch.zeros(2, TOK.seq_len, TOK.bottleneck_dim)
    a, b = _tokens(TOK, B=2, seed=2), _tokens(TOK, B=2, seed=3)
    assert not torch.allclose(stage(join_tokens(zeros, a)), stage(join_tokens(zeros, b)))
    plain = build_stage(dataclasses.replace(TOK, bottleneck_tokens=False), TOK.num_stages - 1)
    assert not plain.takes_tokens
    # every parameter the plain bottleneck has starts the same: the embeddings are drawn after them
    for name, p in plain.named_parameters():
        assert torch.equal(p, dict(stage.named_parameters())[name]), name


def test_the_bottleneck_carries_only_what_the_blocks_wrote_not_the_embedding():
    """Delta coding: the stage before a cut sends down(h - e), e the embedding it added; blocks that write nothing
    leave every token's message at the down projection's bias, whatever its id and position."""
    for index in (0, 1):  # stage 0's own embedding, stage 1's embedding of the ids it received
        stage = build_stage(TOK, index)
        with torch.no_grad():
            for block in stage.blocks:
                for proj in (block.attn.proj, block.mlp.proj):
                    proj.weight.zero_()
                    proj.bias.zero_()
            stage.bottleneck_out.bias.copy_(torch.arange(TOK.bottleneck_dim, dtype=torch.float32))
        ids = _tokens(TOK, B=2)
        x = ids if index == 0 else join_tokens(torch.randn(2, TOK.seq_len, TOK.bottleneck_dim), ids)
        out = stage(x)
        if index == 0:
            expected = stage.bottleneck_out.bias.expand_as(out)
        else:  # what arrived passes through up then down; the embedding added on the way does not
            expected = stage.bottleneck_out(stage.bottleneck_in(x[..., :-1]))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
@pytest.mark.parametrize("distribution", ["normal", "student_t2"])
def test_the_wire_round_trip_keeps_the_ids_exact_and_the_values_within_the_codecs_bound(
    codec: str, distribution: str
):
    g = torch.Generator().manual_seed(0)
    b = TOK.bottleneck_dim
    shape = (4, TOK.seq_len, b)
    if distribution == "normal":
        x = torch.randn(shape, generator=g)
    else:  # heavy tails: Student t with 2 degrees of freedom
        x = torch.distributions.StudentT(2.0).sample(shape)
    ids = _tokens(TOK, B=4)
    wire_codec = get_codec(codec)
    flat = x.reshape(-1).contiguous()
    x_back = wire_codec.decode(wire_codec.encode(flat), flat.numel(), torch.float32).view_as(x)
    raw = get_codec("none")
    wire_ids = ids.to(token_wire_dtype(TOK.vocab_size)).reshape(-1)
    ids_back = raw.decode(raw.encode(wire_ids), ids.numel(), torch.uint8).view_as(ids)
    x2, ids2 = split_tokens(build_stage(TOK, 1).join_tokens(x_back, ids_back))
    assert torch.equal(ids2, ids)
    # per 32-value block, the error is below the codec's step: absmax / levels (the bfloat16 scale rounds up)
    levels = {"int8": 127, "int4": 7, "int2": 1}[codec]
    blocks = flat.view(-1, 32)
    bound = blocks.abs().amax(dim=1, keepdim=True) / levels * 1.01
    assert bool(((x2.reshape(-1, 32) - blocks).abs() <= bound).all())


def test_a_stage_after_the_cut_refuses_a_missing_or_wrong_token_column():
    stage = build_stage(TOK, 1)
    x = torch.randn(2, TOK.seq_len, TOK.bottleneck_dim)
    ids = _tokens(TOK, B=2)
    stage.check_input(join_tokens(x, ids))
    with pytest.raises(
        ValueError, match=r"width 6, expected 7 \(bottleneck_dim \+ 1 for the token ids\)"
    ):
        stage.check_input(x)
    bad = join_tokens(x, ids)
    bad[0, 0, -1] = 256
    with pytest.raises(ValueError, match=r"token ids in \[0, 256\) in its last coordinate"):
        stage.check_input(bad)
    with pytest.raises(ValueError, match="stage 1 takes the token ids with its input"):
        stage.join_tokens(x, None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(bottleneck_tokens=True), "set bottleneck_dim too"),
        (dict(bottleneck_dim=4, bottleneck_tokens=1), "bottleneck_tokens must be a bool"),
        (dict(bottleneck_tokens=True, subspace_dim=8), "set bottleneck_dim too"),
    ],
)
def test_config_checks(kwargs, message):
    base = dict(d_model=32, n_heads=4, n_layers=3, seq_len=16, num_stages=3)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**base, **kwargs})


def test_the_run_record_names_the_scheme_and_a_version_without_it_refuses_it(monkeypatch):
    run = RunConfig(model=TOK, codec="int4")
    record = run.to_dict()
    assert record["model"]["family"] == "gpt-bottleneck-tokens"
    assert record["model"]["bottleneck_tokens"] is True
    assert RunConfig.from_dict(record) == run
    # 6 int4 values (6 * 0.5625 bytes) and a 1-byte id per token, against 32 float32 values (128 bytes)
    assert run.activation_bytes_ratio() == pytest.approx(128 / (6 * 0.5625 + 1))
    assert "bottleneck 6 of 32 dims + token ids" in run.compression_scheme()
    # the version before this scheme read the families (None, "gpt-subspace") only: it refuses the record
    # instead of dropping the unknown field and serving a plain bottleneck that expects no ids
    monkeypatch.setattr(ModelConfig, "FAMILIES", (None, "gpt-subspace"))
    with pytest.raises(
        ValueError, match="family 'gpt-bottleneck-tokens', which this version does not know"
    ):
        RunConfig.from_dict(record)
    monkeypatch.undo()
    # a record whose family and fields disagree is refused, not read as the plain bottleneck
    lying = {
        **record,
        "model": {k: v for k, v in record["model"].items() if k != "bottleneck_tokens"},
    }
    with pytest.raises(ValueError, match="says family 'gpt-bottleneck-tokens', but its fields"):
        RunConfig.from_dict(lying)
    plain = RunConfig(model=dataclasses.replace(TOK, bottleneck_tokens=False))
    assert "family" not in plain.to_dict()["model"]


def test_the_peer_flag_starts_a_run_with_the_ids_beside_the_bottleneck():
    from swarm import cli, runflags

    parser = cli.build_parser(("peer",))
    args = parser.parse_args(
        ["peer", "--preset", "tiny", "--bottleneck-dim", "26", "--bottleneck-tokens"]
        + ["--codec", "int4"]
    )
    run = runflags.run_config_from_args(args)
    assert run.model.bottleneck_dim == 26 and run.model.bottleneck_tokens
    assert run.activation_bytes_ratio() >= 32
    args = parser.parse_args(["peer", "--preset", "tiny", "--bottleneck-tokens"])
    with pytest.raises(ValueError, match="give --bottleneck-dim too"):
        runflags.run_config_from_args(args)


def test_a_cut_adds_its_pair_and_its_embedding_and_leaves_every_other_parameter_as_without_it():
    """A run with a bottleneck (with or without the ids) starts from the plain model's parameters plus its own, so
    its loss against the plain run's is the cut's cost and not another draw of the model (on tiny, another init
    alone moves the loss after 150 steps by 1-2%)."""
    plain = dataclasses.replace(TOK, bottleneck_dim=None, bottleneck_tokens=False)
    for config in (TOK, dataclasses.replace(TOK, bottleneck_tokens=False)):
        for index in range(TOK.num_stages):
            ours = build_stage(config, index).state_dict()
            theirs = build_stage(plain, index).state_dict()
            for name, tensor in theirs.items():
                assert torch.equal(ours[name], tensor), (index, name)
            extra = {name.split(".")[0] for name in ours if name not in theirs}
            expected = set()
            if index < TOK.num_stages - 1:
                expected.add("bottleneck_out")
            if index > 0:
                expected.add("bottleneck_in")
                if config.bottleneck_tokens:
                    expected |= {"cut_tok_emb", "cut_pos_emb"}
            assert extra == expected, (index, extra)


def test_the_receiver_rebuilds_the_senders_embedding_at_init():
    """Every later stage's cut embeddings start as stage 0's embeddings, so with an identity pair (orthogonal, full
    width) the stream after the cut starts as the stream before it."""
    stages = [build_stage(TOK, i) for i in range(TOK.num_stages)]
    for stage in stages[1:]:
        assert torch.equal(stage.cut_tok_emb.weight, stages[0].tok_emb.weight)
        assert torch.equal(stage.cut_pos_emb.weight, stages[0].pos_emb.weight)
    identity = dataclasses.replace(TOK, bottleneck_dim=TOK.d_model, bottleneck_init="orthogonal")
    first, second = build_stage(identity, 0), build_stage(identity, 1)
    ids = _tokens(identity, B=2)
    captured = {}
    first.blocks[-1].register_forward_hook(lambda m, i, out: captured.setdefault("before", out))
    second.blocks[0].register_forward_pre_hook(lambda m, i: captured.setdefault("after", i[0]))
    second(join_tokens(first(ids), ids))
    torch.testing.assert_close(captured["after"], captured["before"], atol=1e-5, rtol=1e-5)
