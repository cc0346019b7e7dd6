"""The parameter digest: what it hashes, when a replica recomputes it, how records carry it, and how replicas
are compared by it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import local_executor, record_wire

from swarm.config import RunConfig
from swarm.coordinator.agreement import agreement, describe_disagreement, step_groups
from swarm.discovery.records import RecordError, StageRecord
from swarm.model import ModelConfig, is_digest, state_digest

MODEL = ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16, num_stages=2, seed=5)
B = 2
# one committed microbatch of B samples is one optimizer step (no warmup: every step moves the parameters)
RUN = RunConfig(model=MODEL, target_batch_size=B, warmup_steps=0)


def _call(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, MODEL.seq_len, MODEL.d_model, generator=g)
    return x, torch.randint(0, MODEL.vocab_size, (B, MODEL.seq_len), generator=g)


def _step(executor, seed: int) -> None:
    executor.forward_loss_backward(f"mb{seed}", *_call(seed), B)
    assert executor.commit(f"mb{seed}")


# ---------------------------------------------------------------------------------------------- the hash


def test_the_digest_covers_every_tensors_name_dtype_shape_and_bytes():
    state = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.zeros(3)}
    digest = state_digest(state)
    assert is_digest(digest) and digest == state_digest({k: v.clone() for k, v in state.items()})
    last = dict(
        state, **{"b.bias": torch.tensor([0.0, 0.0, 1e-30])}
    )  # one element of the last tensor
    renamed = {"a.weight": state["a.weight"], "c.bias": state["b.bias"]}
    reshaped = dict(state, **{"a.weight": state["a.weight"].reshape(3, 2)})
    retyped = dict(
        state, **{"b.bias": torch.zeros(3, dtype=torch.int32)}
    )  # same bytes, other dtype
    reordered = dict(reversed(state.items()))
    variants = [state_digest(s) for s in (last, renamed, reshaped, retyped, reordered)]
    assert len({digest, *variants}) == 6
    # exotic dtypes and scalars hash too
    assert is_digest(state_digest({"s": torch.tensor(1.0, dtype=torch.bfloat16)}))


def test_is_digest_takes_only_sixteen_lowercase_hex_characters():
    assert is_digest("0123456789abcdef")
    assert not any(is_digest(s) for s in ("", "0123456789ABCDEF", "0123456789abcde", "g" * 16))


# ---------------------------------------------------------------------------------------------- executor


def test_equal_replicas_have_equal_digests_and_a_step_changes_only_the_stepped_ones():
    a, b = local_executor(RUN, 1), local_executor(RUN, 1)
    fresh = a.param_digest()
    assert fresh == b.param_digest() == state_digest(a.stage_module.state_dict())
    assert a.step_and_digest() == (0, fresh)
    _step(a, 1)
    # stepped: the old digest is not announced with the new step, and the next hash is of the new parameters
    assert a.step_and_digest() == (1, "")
    stepped = a.param_digest()
    assert stepped != fresh and stepped == state_digest(a.stage_module.state_dict())
    assert a.step_and_digest() == (1, stepped) and b.step_and_digest() == (0, fresh)
    _step(b, 1)  # the same microbatch: the same parameters, bit for bit
    assert b.param_digest() == stepped
    _step(b, 2)
    assert b.param_digest() not in (stepped, fresh)


def test_the_digest_is_hashed_once_per_change_of_the_parameters():
    ex = local_executor(RUN, 1)
    before = ex.param_digest()
    with torch.no_grad():  # written behind the executor's back: the cached digest stays (no rehash)
        next(ex.stage_module.parameters()).add_(1.0)
    assert ex.param_digest() == before
    ex.parameters_changed()
    assert ex.param_digest() == state_digest(ex.stage_module.state_dict()) != before


def test_a_peer_hashes_in_another_thread_and_a_hash_of_replaced_parameters_is_not_kept():
    ex = local_executor(RUN, 1)
    want = state_digest(ex.stage_module.state_dict())
    work = ex.digest_snapshot()
    live = dict(ex.stage_module.state_dict(keep_vars=True))
    assert list(work.state) == list(live) and work.step == 0
    assert all(work.state[k].data_ptr() != t.data_ptr() for k, t in live.items())
    _step(ex, 1)  # the step writes the live parameters in place, never the snapshot
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(state_digest, work.state).result() == want
        # hashed from before the step: not kept as the new parameters' digest
        ex.record_digest(work, want)
        assert ex.step_and_digest() == (1, "")
        later = ex.digest_snapshot()
        ex.record_digest(later, pool.submit(state_digest, later.state).result())
    assert ex.step_and_digest() == (1, state_digest(ex.stage_module.state_dict()))
    assert ex.digest_snapshot() is None  # known: nothing to hash until the parameters change again
    # a call pinned to step 1 runs on the version whose digest is the same
    assert ex.step_and_digest(params_step=1) == ex.step_and_digest()


def test_loading_a_state_changes_the_digest_to_the_states():
    source, target = local_executor(RUN, 1), local_executor(RUN, 1)
    _step(source, 1)
    before = target.param_digest()
    target.load_state(source.state_dict())
    assert target.step_and_digest() == (1, "")
    assert target.param_digest() == source.param_digest() != before


# ---------------------------------------------------------------------------------------------- records


def test_a_record_carries_its_digest_an_older_peers_has_none_and_a_malformed_one_is_refused():
    assert StageRecord.from_wire(record_wire()).param_digest == ""  # an older peer's record
    record = StageRecord.from_wire(record_wire(param_digest="0123456789abcdef"))
    assert StageRecord.from_wire(record.to_wire()) == record
    assert record.param_digest == "0123456789abcdef"
    for bad, needle in [
        (record_wire(param_digest="0123456789ABCDEF"), "param_digest must be 16 lowercase hex"),
        (record_wire(param_digest="zz" * 8), "param_digest must be 16 lowercase hex"),
        (record_wire(param_digest="ab" * 500), "param_digest must be 16 lowercase hex"),
        (record_wire(param_digest=123), "'param_digest' must be str"),
    ]:
        with pytest.raises(RecordError, match=needle):
            StageRecord.from_wire(bad)


# ---------------------------------------------------------------------------------------------- agreement


def _records(*rows, config_hash="abc"):
    return [
        StageRecord.from_wire(
            record_wire(peer_id=p, step=step, param_digest=d, state=state, config_hash=config_hash)
        )
        for p, step, d, state in rows
    ]


X, Y = "1" * 16, "2" * 16


def test_replicas_agree_only_when_every_step_they_share_has_one_digest():
    agreed = _records(("a", 3, X, "serving"), ("b", 3, X, "serving"), ("c", 2, Y, "serving"))
    assert agreement(step_groups(agreed, config_hash="abc")) is True
    split = _records(("a", 3, X, "serving"), ("b", 3, Y, "serving"), ("c", 3, X, "serving"))
    groups = step_groups(split, config_hash="abc")
    assert agreement(groups) is False
    assert describe_disagreement(3, groups[3]) == f"at step 3: {X} (a, c) vs {Y} (b)"
    # nothing comparable: different steps, no digest (an older peer), not serving, another config
    for rows in [
        [("a", 3, X, "serving"), ("b", 2, Y, "serving")],
        [("a", 3, X, "serving"), ("b", 3, "", "serving")],
        [("a", 3, X, "serving"), ("b", 3, Y, "draining")],
    ]:
        assert agreement(step_groups(_records(*rows), config_hash="abc")) is None
    other = _records(("b", 3, Y, "serving"), config_hash="def")
    assert (
        agreement(step_groups(_records(("a", 3, X, "serving")) + other, config_hash="abc")) is None
    )
