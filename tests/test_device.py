"""Devices and compute dtypes (swarm.model.device), on the CPU: flag checks, bf16 autocast stages that train
with float32 master weights and float32 on the wire, fp16 loss scaling, and the stage memory estimate. The
GPU-only checks skip with the reason where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch
from conftest import local_executor

from swarm.config import RunConfig
from swarm.model import ModelConfig
from swarm.model.device import Compute, GradScale, resolve_device
from swarm.peer.config import CacheConfig, PeerConfig
from swarm.peer.memory import (
    DEFAULT_GRAPH_CACHE_BYTES,
    InsufficientMemory,
    auto_graph_cache_bytes,
    check_fits,
    estimate_stage_memory,
    resolve_graph_cache,
)

MODEL = ModelConfig(d_model=64, n_heads=2, n_layers=2, seq_len=32, num_stages=2, seed=5)
RUN = RunConfig(model=MODEL, target_batch_size=8, lr=3e-3, warmup_steps=0)
BF16 = Compute.from_flags("cpu", "bf16")
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_flags_are_checked_with_a_sentence():
    for bad in ("gpu", "cuda:x", "CPU"):
        with pytest.raises(ValueError, match="device must be"):
            PeerConfig(device=bad)
    with pytest.raises(ValueError, match="dtype must be one of fp32, bf16, fp16"):
        PeerConfig(dtype="float16")
    with pytest.raises(ValueError, match="fp16 needs a GPU"):
        Compute.from_flags("cpu", "fp16")
    assert Compute.from_flags("cpu", "bf16").dtype == torch.bfloat16
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_cuda_without_a_gpu_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="torch sees no CUDA device here.*--device cpu"):
        Compute.from_flags("cuda:1", "fp32")


def _train(executors, steps: int, seed: int = 0) -> list[float]:
    """Steps of two-stage training on one repeated batch (the loss must fall); returns the losses."""
    first, last = executors
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, MODEL.vocab_size, (8, MODEL.seq_len + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for i in range(steps):
        mb = f"mb{i}"
        hidden = first.forward(mb, x, keep=True)
        # the wire sees float32 on the host whatever the compute dtype
        assert hidden.dtype == torch.float32 and hidden.device.type == "cpu"
        loss, grad = last.forward_loss_backward(mb, hidden, y, 8)
        assert grad.dtype == torch.float32 and grad.device.type == "cpu"
        assert first.backward(mb, grad, None, 8) is None
        assert last.commit(mb) and first.commit(mb)
        losses.append(loss)
    return losses


def test_bf16_autocast_trains_with_float32_master_weights():
    executors = [local_executor(RUN, k, compute=BF16) for k in (0, 1)]
    losses = _train(executors, 12)
    assert executors[0].step == 12  # one optimizer step per global batch of 8
    assert losses[-1] < 0.8 * losses[0], losses
    for ex in executors:  # master weights and optimizer state stay float32
        assert all(p.dtype == torch.float32 for p in ex.stage_module.parameters())
        assert all(
            t.dtype == torch.float32
            for s in ex.optimizer.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )


def test_bf16_forward_is_close_to_fp32_and_computed_in_bf16():
    fp32, bf16 = local_executor(RUN, 0), local_executor(RUN, 0, compute=BF16)
    x = torch.randint(0, MODEL.vocab_size, (4, MODEL.seq_len))
    want, got = fp32.forward("a", x, keep=False), bf16.forward("a", x, keep=False)
    assert not torch.equal(want, got)  # it did compute in bf16 ...
    # ... within bf16's precision (8 bits of mantissa: ~0.4% per op, a few ops deep)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_grad_scale_backs_off_from_fp16_overflow_and_unscales():
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    want = torch.autograd.grad((x @ w).sum(), [w])[0]
    # an fp16 output; a seed scaled by 2^40 overflows fp16 (max 65504) until the scale has backed off
    scale = GradScale(True, init_scale=2.0**40, growth_interval=2)
    (got,) = scale.grad((x.half() @ w.half()), [w], torch.ones(4, 16))
    assert scale.scale < 2.0**16
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-2)
    # it grows again after growth_interval clean backwards
    grows = GradScale(True, init_scale=2.0, growth_interval=2)
    for _ in range(2):
        grows.grad((x.half() @ w.half()), [w], torch.ones(4, 16))
    assert grows.scale == 4.0
    assert GradScale(False).scale == 1.0


def test_memory_estimate_counts_the_real_parameters_and_the_budgets():
    cache = CacheConfig(graph_cache_bytes=1 << 20, input_cache_bytes=2 << 20, held_gradient_bytes=0)
    est = estimate_stage_memory(MODEL, 1, cache)
    real = sum(p.numel() * 4 for p in local_executor(RUN, 1).stage_module.parameters())
    assert est.parameters == est.gradient_sums == real
    assert est.optimizer_state == 2 * real
    assert est.held_gradients == real  # one gradient is always admitted, whatever the budget
    assert (
        est.param_versions == 2 * real
    )  # the current step's copy and one older (swarm.peer.versions)
    assert est.total == 7 * real + (3 << 20)
    with_avg = estimate_stage_memory(MODEL, 1, cache, compute_dtype=torch.bfloat16, averaging=True)
    assert with_avg.total == est.total + 2 * real + real // 2


def test_a_stage_that_does_not_fit_is_refused_saying_what_to_change():
    est = estimate_stage_memory(MODEL, 0, CacheConfig())
    check_fits(est, 0, torch.device("cpu"), est.total)  # exactly enough
    with pytest.raises(InsufficientMemory, match=r"stage 0 needs about .* --graph-cache-bytes"):
        check_fits(est, 0, torch.device("cpu"), est.total - 1)
    # no limit: against the RAM available, which no machine has this much of
    huge = ModelConfig(d_model=8192, n_heads=8, n_layers=64, seq_len=32, num_stages=1)
    with pytest.raises(InsufficientMemory, match="cpu has available only"):
        check_fits(estimate_stage_memory(huge, 0, CacheConfig()), 0, torch.device("cpu"), None)


def test_an_unset_graph_budget_is_sized_from_the_gpus_free_memory_and_is_256_mib_elsewhere():
    unset = CacheConfig()
    assert unset.graph_cache_bytes is None
    on_cpu = resolve_graph_cache(unset, MODEL, 0, torch.device("cpu"))
    assert on_cpu.graph_cache_bytes == DEFAULT_GRAPH_CACHE_BYTES == 256 << 20
    assert local_executor(RUN, 0).cache_config.graph_cache_bytes == 256 << 20
    # a value given is kept, on any device
    given = CacheConfig(graph_cache_bytes=5)
    assert resolve_graph_cache(given, MODEL, 0, torch.device("cuda")) is given
    # on a GPU: half of what is free beyond everything else, at least the default
    gib = 1 << 30
    assert auto_graph_cache_bytes(80 * gib, 10 * gib) == 35 * gib
    assert auto_graph_cache_bytes(10 * gib, 10 * gib) == DEFAULT_GRAPH_CACHE_BYTES
    assert auto_graph_cache_bytes(None, 10 * gib) == DEFAULT_GRAPH_CACHE_BYTES
    # the estimate counts the budget the stage will run with
    assert estimate_stage_memory(MODEL, 0, unset).graph_cache == 256 << 20


@no_cuda
def test_on_a_gpu_the_unset_graph_budget_follows_the_memory_limit_and_the_stage_fits():
    cuda = torch.device("cuda")
    rest = estimate_stage_memory(MODEL, 0, CacheConfig(graph_cache_bytes=0)).total
    limit = rest + (4 << 30)
    sized = resolve_graph_cache(CacheConfig(), MODEL, 0, cuda, limit_bytes=limit)
    assert sized.graph_cache_bytes == 2 << 30
    check_fits(estimate_stage_memory(MODEL, 0, sized), 0, cuda, limit)
    free = resolve_graph_cache(CacheConfig(), MODEL, 0, cuda)  # what the GPU has free now
    assert free.graph_cache_bytes >= DEFAULT_GRAPH_CACHE_BYTES
    check_fits(estimate_stage_memory(MODEL, 0, free), 0, cuda, None)


@no_cuda
def test_cuda_stage_matches_the_cpu_stage_and_returns_host_float32():
    cuda = Compute.from_flags("cuda", "fp32")
    on_gpu = local_executor(RUN, 0, compute=cuda, device=cuda.device)
    on_cpu = local_executor(RUN, 0)
    x = torch.randint(0, MODEL.vocab_size, (4, MODEL.seq_len))
    got = on_gpu.forward("a", x, keep=True)
    assert got.device.type == "cpu" and got.dtype == torch.float32
    torch.testing.assert_close(got, on_cpu.forward("a", x, keep=True), rtol=1e-4, atol=1e-4)


@no_cuda
def test_cuda_bf16_and_fp16_train():
    for dtype in ("bf16", "fp16"):
        compute = Compute.from_flags("cuda", dtype)
        executors = [local_executor(RUN, k, compute=compute, device=compute.device) for k in (0, 1)]
        losses = _train(executors, 12)
        assert losses[-1] < 0.8 * losses[0], (dtype, losses)
