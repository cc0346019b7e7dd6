"""The stage executor's speed bookkeeping (calibration, the emulated slow device used for fault injection) and
its bound on gradients waiting for their commit."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import local_executor

from swarm.config import RunConfig
from swarm.errors import PeerOverloaded
from swarm.model import ModelConfig
from swarm.peer.executor import CacheConfig

MODEL = ModelConfig(d_model=64, n_heads=2, n_layers=2, seq_len=32, num_stages=2, seed=3)
RUN = RunConfig(model=MODEL, target_batch_size=64)


def test_emulated_slow_device_is_slower_by_its_factor_and_measures_it():
    fast = local_executor(RUN, 0)
    slow = local_executor(RUN, 0, slowdown=5.0)
    # The seed of the announced speed is what the emulated device takes: about a fifth of the full speed.
    # The calibrations take turns and each keeps its best, so a spell of load on this shared machine meets
    # both alike (a margin remains for what it does to one run).
    best_fast = best_slow = 0.0
    for _ in range(3):
        best_fast = max(best_fast, fast.calibrate(8))
        best_slow = max(best_slow, slow.calibrate(8))
    assert 0.1 * best_fast < best_slow < 0.35 * best_fast
    tokens = torch.randint(0, MODEL.vocab_size, (8, MODEL.seq_len))
    t0, c0 = time.perf_counter(), time.thread_time()
    slow.forward("mb", tokens, keep=True)
    took, cpu = time.perf_counter() - t0, time.thread_time() - c0
    # The call holds the compute thread for its compute plus 4x that compute asleep (compute = this thread's
    # CPU time, torch being single-threaded here; measured out here it also counts the call's own checks).
    assert torch.get_num_threads() == 1
    assert took >= 3.5 * cpu
    before = slow.throughput
    grad = torch.randn(8, MODEL.seq_len, MODEL.d_model)
    slow.backward("mb", grad, None, 8)
    slow.commit("mb")
    # What it measures includes the emulated time, so it stays near a fifth of the full speed.
    assert slow.throughput < 0.5 * fast.throughput and slow.throughput == pytest.approx(
        before, rel=0.5
    )
    assert slow.samples_applied == 8 and slow.busy_s >= took


def test_slowdown_below_one_is_refused():
    with pytest.raises(ValueError, match="slowdown is a factor >= 1"):
        local_executor(RUN, 0, slowdown=0.5)


@pytest.fixture
def executors():
    """A two-stage run's executors that hold at most two uncommitted gradients each."""
    cache = CacheConfig(max_pending=2)
    return [local_executor(RUN, stage, cache=cache) for stage in (0, 1)]


def test_a_full_pending_queue_refuses_new_work_before_computing_and_loses_nothing(executors):
    first, last = executors
    tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len + 1))
    x, targets = tokens[:, :-1], tokens[:, 1:]
    h = {mb: first.forward(mb, x, keep=True) for mb in ("a", "b", "c")}
    replies = {mb: last.forward_loss_backward(mb, h[mb], targets, 2) for mb in ("a", "b")}
    grads = {mb: first.backward(mb, replies[mb][1], None, 2) for mb in ("a", "b")}
    busy = (last.busy_s, first.busy_s)
    with pytest.raises(PeerOverloaded, match=r"2 computed gradients already wait.*max_pending=2"):
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
