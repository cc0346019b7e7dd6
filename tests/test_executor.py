"""The stage executor's speed bookkeeping (calibration, the emulated slow device used for fault injection), its
bound on gradients waiting for their commit, its graph and input caches, abort, and exactly-once commits."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import local_executor

from swarm.config import RunConfig
from swarm.errors import AlreadyApplied, GradientsDropped, NotCached, PeerOverloaded
from swarm.model import ModelConfig
from swarm.peer.executor import CacheConfig

MODEL = ModelConfig(d_model=64, n_heads=2, n_layers=2, seq_len=32, num_stages=2, seed=3)
RUN = RunConfig(model=MODEL, target_batch_size=64)


def test_emulated_slow_device_is_slower_by_its_factor_and_measures_it():
    fast = local_executor(RUN, 0)
    slow = local_executor(RUN, 0, slowdown=5.0)
    # The seed of the announced speed is what the emulated device takes: about a fifth of the full speed on an
    # idle machine. Under load the ratio is not a fifth: compute waiting for a core takes k times its CPU time
    # while the emulated sleep stays 4x the CPU time, so slow/fast = k / (k + 4) (0.38 at k = 2.5, measured
    # under sustained contention). What holds at any k is the order; the calibrations take turns and each
    # keeps its best, so a spell of load meets both alike.
    best_fast = best_slow = 0.0
    for _ in range(3):
        best_fast = max(best_fast, fast.calibrate(8))
        best_slow = max(best_slow, slow.calibrate(8))
    assert 0 < best_slow < best_fast
    tokens = torch.randint(0, MODEL.vocab_size, (8, MODEL.seq_len))
    t0, c0 = time.perf_counter(), time.thread_time()
    slow.forward("mb", tokens, keep=True)
    took, cpu = time.perf_counter() - t0, time.thread_time() - c0
    # The call holds the compute thread for its compute plus 4x that compute asleep (compute = this thread's
    # CPU time, torch being single-threaded here, so load does not stretch the sleep; wall time >= CPU time
    # makes this hold at any load; 3.5 rather than 5 because the CPU time measured out here also counts the
    # call's own checks, which are not slowed).
    assert torch.get_num_threads() == 1
    assert took >= 3.5 * cpu
    grad = torch.randn(8, MODEL.seq_len, MODEL.d_model)
    slow.backward("mb", grad, None, 8)
    slow.commit("mb")
    # What it measures includes the emulated time: its busy time covers the slowed call, and it still measures
    # itself slower than the full-speed executor.
    assert slow.throughput < fast.throughput
    assert slow.samples_applied == 8 and slow.busy_s >= took


def test_slowdown_below_one_is_refused():
    with pytest.raises(ValueError, match="slowdown is a factor >= 1"):
        local_executor(RUN, 0, slowdown=0.5)


@pytest.fixture
def executors():
    """A two-stage run's executors whose held-gradient budget fits two uncommitted gradients each (a stage's
    parameter gradients and its reply's (2, T, D) input gradient), not three."""
    activation_bytes = 2 * MODEL.seq_len * MODEL.d_model * 4
    out = []
    for stage in (0, 1):
        one = local_executor(RUN, stage).gradient_bytes + activation_bytes
        out.append(local_executor(RUN, stage, cache=CacheConfig(held_gradient_bytes=2 * one)))
    return out


def test_a_full_pending_queue_refuses_new_work_before_computing_and_loses_nothing(executors):
    first, last = executors
    tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len + 1))
    x, targets = tokens[:, :-1], tokens[:, 1:]
    h = {mb: first.forward(mb, x, keep=True) for mb in ("a", "b", "c")}
    replies = {mb: last.forward_loss_backward(mb, h[mb], targets, 2) for mb in ("a", "b")}
    grads = {mb: first.backward(mb, replies[mb][1], None, 2) for mb in ("a", "b")}
    busy = (last.busy_s, first.busy_s)
    with pytest.raises(
        PeerOverloaded, match=r"2 computed gradients \(.* MiB\) already wait.*--held-gradient-bytes"
    ):
        last.forward_loss_backward("c", h["c"], targets, 2)
    with pytest.raises(PeerOverloaded, match="retry at another peer"):
        first.backward("c", replies["a"][1], None, 2)
    assert PeerOverloaded.retry_elsewhere
    # Refused before any compute: nothing was measured as work beyond the checks.
    assert last.busy_s - busy[0] < 0.05 and first.busy_s - busy[1] < 0.05
    # A retry of a call whose reply is pending is not new work: it gets the same reply.
    assert last.forward_loss_backward("b", h["b"], targets, 2)[0] == replies["b"][0]
    assert first.backward("a", replies["a"][1], None, 2) is grads["a"]
    # Every held gradient still counts once committed; then there is room again.
    assert all(ex.commit(mb) for ex in executors for mb in ("a", "b"))
    assert last.microbatches_applied == first.microbatches_applied == 2
    last.forward_loss_backward("c", h["c"], targets, 2)
    assert last.commit("c")


# ---------------------------------------------------------------- caches, abort, exactly once

NO_STEP = RunConfig(model=MODEL, target_batch_size=10_000)  # gradients only accumulate
B = 2


def _tokens(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (B, MODEL.seq_len), generator=g)  # (B, T)


def _grad_output(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(B, MODEL.seq_len, MODEL.d_model, generator=g)  # (B, T, D)


def _grad_sums(ex) -> dict[str, torch.Tensor]:
    return {k: v for k, v in ex.snapshot(include_grads=True).items() if k.startswith("grad/")}


def _assert_same_grads(a, b) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7, msg=name)


def _train_first_stage(ex, ids: str, inputs_for: str = "") -> None:
    """Backward and commit each microbatch of ``ids`` on a stage-0 executor (the inputs sent along for those
    in ``inputs_for``)."""
    for seed, mb in enumerate(ids):
        inputs = _tokens(seed) if mb in inputs_for else None
        assert ex.backward(mb, _grad_output(seed), inputs, B) is None  # stage 0: no input gradient
        assert ex.commit(mb)


def test_beyond_the_graph_cache_only_inputs_are_kept_and_backward_recomputes_the_same_gradients():
    roomy = local_executor(NO_STEP, 0)
    roomy.forward("probe", _tokens(0), keep=False)
    one_graph = local_executor(NO_STEP, 0)
    one_graph.forward("probe", _tokens(0), keep=True)
    graph_bytes = one_graph.graphs_kept[1]  # what autograd saves for one microbatch
    assert graph_bytes > 0
    small = local_executor(NO_STEP, 0, cache=CacheConfig(graph_cache_bytes=graph_bytes))
    outs = [
        [ex.forward(mb, _tokens(seed), keep=True) for seed, mb in enumerate("abc")]
        for ex in (small, roomy)
    ]
    assert small.cached_microbatches == roomy.cached_microbatches == 3
    assert small.graphs_kept == (1, graph_bytes) and roomy.graphs_kept == (3, 3 * graph_bytes)
    for kept, recomputed in zip(*outs):  # whether the graph was kept does not change the output
        assert torch.equal(kept, recomputed)
    _train_first_stage(small, "abc")
    _train_first_stage(roomy, "abc")
    assert small.cached_microbatches == roomy.cached_microbatches == 0
    assert small.samples_accumulated == roomy.samples_accumulated == 3 * B
    _assert_same_grads(_grad_sums(small), _grad_sums(roomy))


def test_the_input_cache_evicts_the_oldest_first_and_a_backward_without_inputs_then_asks_for_them():
    token_bytes = B * MODEL.seq_len * 8  # int64 token ids
    ex = local_executor(NO_STEP, 0, cache=CacheConfig(input_cache_bytes=2 * token_bytes))
    reference = local_executor(NO_STEP, 0)
    for seed, mb in enumerate("abc"):
        ex.forward(mb, _tokens(seed), keep=True)
        reference.forward(mb, _tokens(seed), keep=True)
    assert ex.cached_microbatches == 2
    with pytest.raises(NotCached, match="microbatch a is not cached here"):
        ex.backward("a", _grad_output(0), None, B)
    assert ex.samples_accumulated == 0
    # b and c are still cached; a is recomputed from its resent inputs, to the same gradients.
    _train_first_stage(ex, "abc", inputs_for="a")
    _train_first_stage(reference, "abc")
    assert ex.samples_accumulated == 3 * B and ex.cached_microbatches == 0
    _assert_same_grads(_grad_sums(ex), _grad_sums(reference))


def _last_stage_call(seed: int):
    """A last-stage microbatch: hidden states (B, T, D) and targets (B, T)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, MODEL.seq_len, MODEL.d_model, generator=g)
    return x, torch.randint(0, MODEL.vocab_size, (B, MODEL.seq_len), generator=g)


def test_abort_drops_the_held_gradients_so_a_later_commit_adds_nothing():
    last = local_executor(NO_STEP, 1)
    x, targets = _last_stage_call(0)
    loss, _ = last.forward_loss_backward("a", x, targets, B)
    last.abort("a")
    # The late commit is told, never answered OK: its caller computes the gradient again.
    with pytest.raises(GradientsDropped, match="nothing counted .the call ended before its reply"):
        last.commit("a")
    assert (last.microbatches_applied, last.samples_applied, last.samples_accumulated) == (0, 0, 0)
    assert all(int(g.count_nonzero()) == 0 for g in _grad_sums(last).values())
    # The caller retries: the peer computes afresh and counts the microbatch once.
    assert last.forward_loss_backward("a", x, targets, B)[0] == loss
    assert last.commit("a") and last.samples_accumulated == B


def test_a_retried_call_returns_the_same_reply_and_counts_once_even_after_its_reply_left_the_cache():
    last = local_executor(NO_STEP, 1, cache=CacheConfig(reply_cache_size=1))
    calls = {mb: _last_stage_call(seed) for seed, mb in enumerate("ab")}
    reply_a = last.forward_loss_backward("a", *calls["a"], B)
    assert last.commit("a")
    once = _grad_sums(last)
    # The reply was lost on the way: the retry gets the same reply and holds nothing new.
    assert last.forward_loss_backward("a", *calls["a"], B) is reply_a
    assert last.commit("a") is False
    reply_b = last.forward_loss_backward("b", *calls["b"], B)
    assert last.commit("b")
    both = _grad_sums(last)
    # a's reply left the one-reply cache: a retry is refused, never recomputed and counted again.
    with pytest.raises(AlreadyApplied, match="microbatch a was already applied .* it counts once"):
        last.forward_loss_backward("a", *calls["a"], B)
    assert last.forward_loss_backward("b", *calls["b"], B) is reply_b
    assert last.commit("b") is False
    assert (last.microbatches_applied, last.samples_accumulated) == (2, 2 * B)
    _assert_same_grads(_grad_sums(last), both)
    assert any(not torch.equal(once[k], both[k]) for k in once)


def test_a_retried_stage0_backward_whose_reply_is_none_still_counts_once():
    first = local_executor(NO_STEP, 0)
    _train_first_stage(first, "a", inputs_for="a")
    once = _grad_sums(first)
    assert first.backward("a", _grad_output(0), _tokens(0), B) is None
    assert first.commit("a") is False
    assert (first.microbatches_applied, first.samples_accumulated) == (1, B)
    _assert_same_grads(_grad_sums(first), once)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """The commit ledger's clock, moved by hand."""
    import swarm.peer.ledger

    fake = FakeClock()
    monkeypatch.setattr(swarm.peer.ledger, "time", fake)
    return fake


def test_held_gradients_wait_for_their_commit_only_the_hold_then_a_commit_is_refused(clock):
    one = local_executor(NO_STEP, 1).gradient_bytes  # the budget fits one held gradient, not two
    last = local_executor(
        NO_STEP, 1, cache=CacheConfig(commit_hold_s=10.0, held_gradient_bytes=one)
    )
    calls = {mb: _last_stage_call(seed) for seed, mb in enumerate("ab")}
    last.forward_loss_backward("a", *calls["a"], B)
    clock.now += 9.9  # within the hold: the commit (say, through the Commit RPC after a broken stream) counts
    assert last.commit("a") is True
    assert (
        last.commit("a") is False
    )  # idempotent: asked again, answered "applied before", counted once
    once = _grad_sums(last)
    last.forward_loss_backward("b", *calls["b"], B)
    # The one held gradient fills the budget: new gradient work is refused, nothing is evicted for it.
    with pytest.raises(PeerOverloaded):
        last.forward_loss_backward("c", *calls["a"], B)
    clock.now += (
        10.0  # the hold is over: the gradient is dropped, and a commit can no longer count it
    )
    with pytest.raises(
        GradientsDropped, match=r"no commit came within the 10s hold after its reply"
    ):
        last.commit("b")
    assert (last.microbatches_applied, last.samples_accumulated) == (1, B)
    _assert_same_grads(_grad_sums(last), once)
    # The expired hold made room; the caller's recompute of b counts once.
    last.forward_loss_backward("b", *calls["b"], B)
    assert last.commit("b") is True and last.microbatches_applied == 2


def test_a_commit_for_gradients_never_computed_here_is_refused_and_counts_nothing():
    last = local_executor(NO_STEP, 1)
    with pytest.raises(GradientsDropped, match="none were computed here"):
        last.commit("never")
    assert (last.microbatches_applied, last.samples_accumulated) == (0, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"commit_hold_s": 0}, "commit_hold_s must be > 0"),
        ({"graph_cache_bytes": -1}, "cache sizes must be >= 0"),
        ({"held_gradient_bytes": -1}, r"held_gradient_bytes \(-1\) must be >= 0"),
        ({"applied_ids_size": 0}, r"applied_ids_size \(0\) >= 1"),
    ],
)
def test_cache_config_refuses_sizes_that_would_refuse_or_forget_everything(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(**kwargs)


def test_a_gradient_far_larger_than_the_stages_recent_ones_is_refused_and_nothing_is_held():
    """One caller's hostile or corrupted grad_output cannot swamp the stage's global batch: once the stage has a
    reference (swarm.outliers.MIN gradients), a gradient per sample over max_gradient_ratio times the lower
    quartile of its recent ones is refused with a sentence, nothing held or counted; honest ones still pass."""
    from swarm.errors import GradientOutlier
    from swarm.outliers import MIN

    first = local_executor(RUN, 0, cache=CacheConfig(max_gradient_ratio=1000.0))
    tokens = torch.randint(
        0, MODEL.vocab_size, (2, MODEL.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    x = tokens[:, :-1]
    grad_output = torch.randn(
        2, MODEL.seq_len, MODEL.d_model, generator=torch.Generator().manual_seed(1)
    )
    for i in range(MIN):
        first.forward(f"ok{i}", x, keep=True)
        first.backward(f"ok{i}", grad_output, None, 2)
        assert first.commit(f"ok{i}")
    first.forward("huge", x, keep=True)
    with pytest.raises(
        GradientOutlier, match=r"parameter gradient per sample is .*x the lower quartile.*refused"
    ):
        first.backward("huge", 1e6 * grad_output, None, 2)
    with pytest.raises(GradientsDropped):
        first.commit("huge")  # nothing was held for it
    assert first.microbatches_applied == MIN
    # a gradient of the usual size still passes
    first.forward("again", x, keep=True)
    first.backward("again", 2 * grad_output, None, 2)
    assert first.commit("again") and first.microbatches_applied == MIN + 1
    # and without the bound (the default) it passes
    free = local_executor(RUN, 0)
    for i in range(MIN):
        free.forward(f"ok{i}", x, keep=True)
        free.backward(f"ok{i}", grad_output, None, 2)
    free.forward("huge", x, keep=True)
    free.backward("huge", 1e6 * grad_output, None, 2)
