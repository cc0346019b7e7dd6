"""Parameter versions (swarm.peer.versions): a graph kept across an optimizer step stays valid and its backward
gives the gradient of the parameters its forward ran on; a call pinned to an older step computes on that step's
parameters; what a replica does not hold is counted, and the copies it keeps are bounded."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import local_executor

from swarm.config import RunConfig
from swarm.model import ModelConfig
from swarm.peer.executor import CacheConfig

pytestmark = pytest.mark.unit

# Three stages, so the middle one takes activations and answers an input gradient (which depends on its
# parameters); every microbatch of B samples fills the global batch, so each commit steps.
MODEL = ModelConfig(d_model=32, n_heads=2, n_layers=3, seq_len=16, num_stages=3, seed=5)
B = 2
RUN = RunConfig(model=MODEL, target_batch_size=B, lr=1e-2, warmup_steps=0)


def _activations(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, MODEL.seq_len, MODEL.d_model, generator=g)  # (B, T, D)


def _input_grad(module, x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(module(leaf), leaf, grad_output)
    return grad


def _step(ex, mb: str, seed: int) -> None:
    """One microbatch through the middle stage and its commit: the executor steps."""
    before = ex.step
    ex.forward(mb, _activations(seed), keep=True)
    ex.backward(mb, _activations(100 + seed), None, B)
    ex.commit(mb)
    assert ex.step == before + 1


def test_a_graph_kept_across_a_step_gives_the_gradient_of_the_parameters_its_forward_used():
    ex = local_executor(RUN, 1)
    initial = copy.deepcopy(ex.stage_module)
    x, grad_output = _activations(1), _activations(2)
    ex.forward("b", x, keep=True)
    _step(ex, "a", 0)  # the parameters move while "b" waits for its backward
    stepped = copy.deepcopy(ex.stage_module)
    grad_input = ex.backward("b", grad_output, None, B)
    assert ex.backwards_from_graph == 2 and ex.backwards_recomputed == 0
    torch.testing.assert_close(grad_input, _input_grad(initial, x, grad_output))
    # (the test would tell the two apart: the step changed the input gradient)
    assert not torch.allclose(grad_input, _input_grad(stepped, x, grad_output))


def test_a_call_pinned_to_the_previous_step_computes_on_its_parameters():
    ex = local_executor(RUN, 1)
    initial = copy.deepcopy(ex.stage_module)
    _step(ex, "a", 0)
    x = _activations(3)
    with torch.no_grad():
        old, new = initial(x), ex.stage_module(x)
    assert not torch.allclose(old, new)
    torch.testing.assert_close(ex.forward("p", x, keep=True, params_step=0), old)
    torch.testing.assert_close(ex.forward("q", x, keep=False), new)
    assert ex.step_and_digest(0)[0] == 0 and ex.step_and_digest(1)[0] == 1
    # its backward (from the graph, or recomputed from the inputs) stays on step 0's parameters
    grad_output = _activations(4)
    expected = _input_grad(initial, x, grad_output)
    torch.testing.assert_close(ex.backward("p", grad_output, None, B), expected)
    ex.abort("p")
    torch.testing.assert_close(ex.backward("r", grad_output, x, B, 0), expected)
    assert ex.missed_param_steps == 0


def test_a_replica_keeps_only_kept_param_steps_older_versions_and_counts_calls_for_others():
    ex = local_executor(RUN, 1)
    for seed, mb in enumerate("abc"):
        _step(ex, mb, seed)
    assert ex.param_steps == [2, 3]
    ex.forward("old", _activations(5), keep=False, params_step=0)  # step 0's parameters are gone
    assert ex.missed_param_steps == 1
    assert ex.step_and_digest(0)[0] == 2  # the reply names the parameters it really used

    only_current = local_executor(RUN, 1, cache=CacheConfig(kept_param_steps=0))
    only_current.forward("b", _activations(1), keep=True)
    _step(only_current, "a", 0)
    assert only_current.param_steps == [1] and only_current.graphs_kept == (0, 0)
    only_current.backward("b", _activations(2), None, B)  # its graph was dropped at the step
    # it recomputed on the parameters held (no call asked for a step: nothing missed)
    assert only_current.backwards_recomputed == 1 and only_current.missed_param_steps == 0


def test_cache_config_refuses_a_negative_count_of_kept_steps():
    with pytest.raises(ValueError, match="kept_param_steps=-1"):
        CacheConfig(kept_param_steps=-1)
