"""Stage optimizers without networking (schedule, AdamW groups, per-stage clipping and the non-finite skip, the
later-batches buffer, the single-process reference), and the fence around hivemind's private API: swarm.optim
imports no hivemind; the fence refuses any other hivemind version."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from swarm.compression import get_codec
from swarm.config import RunConfig
from swarm.data import ByteCorpus
from swarm.model import ModelConfig, build_full_model, build_stage, evaluate
from swarm.optim import LaterBatches, adamw_param_groups, build_stage_optimizer, learning_rate
from swarm.trainer.reference import CodecWire, train_reference

pytestmark = pytest.mark.integration

SMALL = ModelConfig(d_model=32, n_heads=4, n_layers=3, seq_len=16, num_stages=2, seed=7)


def test_learning_rate_schedule_warms_up_then_decays_to_a_tenth():
    run = RunConfig(lr=1e-3, warmup_steps=10, total_steps=110)
    assert learning_rate(run, 0) == pytest.approx(1e-4)
    assert learning_rate(run, 9) == pytest.approx(1e-3)
    assert learning_rate(run, 60) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert learning_rate(run, 110) == pytest.approx(1e-4) and learning_rate(
        run, 500
    ) == pytest.approx(1e-4)
    assert learning_rate(RunConfig(lr=1e-3, warmup_steps=0), 1000) == 1e-3


def test_adamw_groups_decay_matrices_only():
    groups = adamw_param_groups(build_stage(SMALL, 0), 0.1)
    assert groups[0]["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in groups[0]["params"])
    assert groups[1]["weight_decay"] == 0.0 and all(p.dim() == 1 for p in groups[1]["params"])


def test_train_reference_reports_losses_and_throughput():
    text = bytes(range(32, 127)) * 40
    corpus = ByteCorpus.from_bytes(text[:3000], text[3000:])
    run = RunConfig(model=SMALL, target_batch_size=8, lr=3e-3, warmup_steps=0)
    seen = []
    started = time.perf_counter()
    result = train_reference(
        run,
        corpus,
        steps=6,
        microbatch_size=4,
        eval_every_steps=3,
        eval_batches=2,
        on_step=lambda step, loss: seen.append(step),
    )
    wall_s = time.perf_counter() - started
    assert len(result.losses) == 6 and seen == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in result.val_losses] == [3, 6]
    assert result.losses[-1] < result.losses[0]
    assert result.tokens == 6 * 8 * SMALL.seq_len
    # the training time is a part of the call's wall time (the evaluations are left out)
    assert 0 < result.train_time_s < wall_s
    assert result.tokens_per_s == result.tokens / result.train_time_s
    again = train_reference(run, corpus, steps=6, microbatch_size=4, eval_batches=0)
    assert again.losses == pytest.approx(result.losses, rel=1e-5) and again.val_losses == []
    stopped = train_reference(
        run, corpus, steps=6, microbatch_size=4, eval_batches=2, on_step=lambda s, _: s == 2
    )
    assert stopped.losses == pytest.approx(result.losses[:2], rel=1e-5)
    assert [step for step, _ in stopped.val_losses] == [2]


def test_train_reference_applies_each_batch_delay_steps_batches_late():
    """With ``delay_steps`` d, batch e computes on the parameters after the steps on batches 0 .. e - d - 1 (what the
    swarm's pinned batches do one batch ahead), and every batch is applied by the end."""
    text = bytes(range(32, 127)) * 40
    corpus = ByteCorpus.from_bytes(text[:3000], text[3000:])
    run = RunConfig(model=SMALL, target_batch_size=8, lr=3e-3, warmup_steps=0)

    def train(delay: int):
        return train_reference(
            run, corpus, steps=4, microbatch_size=4, eval_batches=2, delay_steps=delay
        )

    # every batch on the initial parameters: the steps all come at the end
    frozen, lockstep, delayed = train(4), train(0), train(2)
    assert delayed.losses[:3] == frozen.losses[:3] and delayed.losses[3] != frozen.losses[3]
    assert lockstep.losses[0] == frozen.losses[0] and lockstep.losses[1] != frozen.losses[1]
    untrained = evaluate(build_full_model(SMALL), corpus.val_batches(4, SMALL.seq_len, 2))
    assert frozen.val_loss < untrained  # its four steps were taken before the validation
    with pytest.raises(ValueError, match="delay_steps must be >= 0"):
        train(-1)


def test_train_reference_with_the_wire_round_trips_each_cut_through_the_run_codecs():
    """``wire=True``: the activations crossing each cut come out of the run's codec and their gradients out of its
    gradient codec, in training and validation; codec none changes nothing, and a lossy codec changes the run."""
    text = bytes(range(32, 127)) * 40
    corpus = ByteCorpus.from_bytes(text[:3000], text[3000:])
    run = RunConfig(model=SMALL, target_batch_size=8, lr=3e-3, warmup_steps=0)

    def train(run: RunConfig, wire: bool):
        return train_reference(run, corpus, steps=3, microbatch_size=4, eval_batches=2, wire=wire)

    plain = train(run, False)
    assert train(run, True).losses == plain.losses  # none: the identity, bit for bit
    int2 = train(replace(run, codec="int2"), True)
    assert int2.losses[0] != plain.losses[0] and int2.val_loss != plain.val_loss
    # the forward loss alone is the int2 one; the backward's codec changes only what the later steps see
    int2_fp32_back = train(replace(run, codec="int2", grad_codec="none"), True)
    assert (
        int2_fp32_back.losses[0] == int2.losses[0] and int2_fp32_back.losses[1:] != int2.losses[1:]
    )

    model = build_full_model(SMALL)
    model.wire = CodecWire("int8", "int2")
    tokens = corpus.val_batches(4, SMALL.seq_len, 1)[0]
    seen = []
    model.stages[1].register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    h = model.stages[0](tokens[:, :-1])
    model(tokens[:, :-1])
    sent = CodecWire.round_trip(get_codec("int8"), h)
    assert not torch.equal(sent, h) and torch.equal(
        seen[0], sent
    )  # stage 1 took what int8 delivers
    cut = h.detach().requires_grad_()
    grad = torch.randn_like(h)
    model.wire(cut).backward(grad)
    assert torch.equal(cut.grad, CodecWire.round_trip(get_codec("int2"), grad))


# Four stages: each clips its own gradient to max_grad_norm / sqrt(4) = 0.5. No weight decay, so a step moves
# a parameter by its AdamW update alone.
CLIPPED = RunConfig(
    model=ModelConfig(d_model=32, n_heads=4, n_layers=4, seq_len=16, num_stages=4),
    max_grad_norm=1.0,
    weight_decay=0.0,
)


def _gradients(module: nn.Module, norm: float, seed: int = 0) -> list[torch.Tensor]:
    """Random gradients for ``module``'s parameters whose global L2 norm is ``norm``."""
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g) for p in module.parameters()]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads]))
    return [x * (norm / total) for x in grads]


def _step(optimizer, module: nn.Module, grads: list[torch.Tensor]):
    for p, grad in zip(module.parameters(), grads):
        p.grad = grad.clone()
    return optimizer.step()


@pytest.mark.parametrize(
    ("max_grad_norm", "norm", "applied_norm"),
    [
        (1.0, 10.0, 0.5),  # above the stage's threshold: scaled down to exactly 1 / sqrt(4)
        (1.0, 0.3, 0.3),  # below it: untouched
        (0.0, 1000.0, 1000.0),  # 0 turns clipping off
    ],
)
def test_a_stage_clips_its_gradient_to_max_grad_norm_over_sqrt_num_stages(
    max_grad_norm, norm, applied_norm
):
    module = nn.Linear(3, 2)
    optimizer = build_stage_optimizer(module, replace(CLIPPED, max_grad_norm=max_grad_norm))
    grads = _gradients(module, norm)
    _step(optimizer, module, grads)
    assert optimizer.last_grad_norm == pytest.approx(norm, rel=1e-6)  # the norm before clipping
    for p, grad in zip(module.parameters(), grads):
        expected = grad * (applied_norm / norm)  # same direction, the applied norm
        if applied_norm == norm:
            assert torch.equal(p.grad, grad)
        else:
            torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=0)
        # AdamW's first moment after one step from zero is (1 - beta1) x the gradient it used
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], 0.1 * expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_gradient_skips_the_step_and_the_next_finite_one_applies(bad):
    module = nn.Linear(3, 2)
    optimizer = build_stage_optimizer(module, CLIPPED, lr=0.1)
    before = [p.detach().clone() for p in module.parameters()]
    grads = _gradients(module, 0.3)
    poisoned = [x.clone() for x in grads]
    poisoned[0][1, 2] = bad
    assert _step(optimizer, module, poisoned) is None
    assert not math.isfinite(optimizer.last_grad_norm) and optimizer.skipped_steps == 1
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))
    assert all(p.grad is None for p in module.parameters())  # the bad gradients are dropped
    assert optimizer.state == {}  # no moment saw them
    _step(optimizer, module, grads)
    assert optimizer.skipped_steps == 1
    for p, b, grad in zip(module.parameters(), before, grads):
        assert int(optimizer.state[p]["step"]) == 1
        # AdamW's first step moves each value by lr x sign(gradient) (to its epsilon)
        torch.testing.assert_close(p.detach(), b - 0.1 * grad.sign(), rtol=0, atol=1e-5)


def test_later_batches_sum_per_step_and_pop_the_oldest_due_step_first():
    later = LaterBatches(max_ahead=4)
    first = torch.tensor([1.0, 2.0])
    later.add(2, 0, [first, None], 3)
    later.add(1, 0, [torch.tensor([10.0, 0.0]), torch.tensor([5.0])], 1)
    later.add(2, 0, [torch.tensor([0.5, 0.5]), torch.tensor([7.0])], 2)
    assert torch.equal(first, torch.tensor([1.0, 2.0]))  # the caller's tensor is not summed into
    assert later.pop_due(0) is None
    step, sums, n = later.pop_due(2)
    assert step == 1 and n == 1 and torch.equal(sums[0], torch.tensor([10.0, 0.0]))
    assert torch.equal(sums[1], torch.tensor([5.0]))
    step, sums, n = later.pop_due(2)
    assert step == 2 and n == 5 and torch.equal(sums[0], torch.tensor([1.5, 2.5]))
    assert torch.equal(sums[1], torch.tensor([7.0]))  # a None slot takes the first gradient it gets
    assert later.pop_due(2) is None


def test_later_batches_keep_a_step_beyond_max_ahead_with_the_furthest_step_allowed():
    later = LaterBatches(max_ahead=2)
    later.add(9, 3, [torch.tensor([1.0])], 4)  # 6 ahead of step 3: kept with step 5
    later.add(5, 3, [torch.tensor([2.0])], 1)
    assert later.pop_due(4) is None
    step, sums, n = later.pop_due(5)
    assert step == 5 and n == 5 and torch.equal(sums[0], torch.tensor([3.0]))
    assert later.pop_due(100) is None


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_optim_imports_no_hivemind():
    done = _python(
        "import swarm.optim, sys; "
        "assert not any(m.startswith('hivemind') for m in sys.modules), "
        "sorted(m for m in sys.modules if m.startswith('hivemind'))"
    )
    assert done.returncode == 0, done.stderr


def test_hivemind_fence_accepts_only_the_pinned_version(monkeypatch):
    import hivemind

    from swarm.averaging import hivemind_private

    hivemind_private.check_hivemind_version()  # the installed one is the pinned one
    monkeypatch.setattr(hivemind, "__version__", "1.2.0")
    with pytest.raises(
        hivemind_private.UnsupportedHivemind,
        match=r"needs hivemind 1\.1\.12 .* hivemind 1\.2\.0 is installed; "
        r"run: pip install hivemind==1\.1\.12",
    ):
        hivemind_private.check_hivemind_version()


def test_cli_says_in_one_line_that_the_hivemind_is_unsupported():
    done = _python(
        "import hivemind, sys; hivemind.__version__ = '1.2.0'; import swarm.cli; "
        "sys.exit(swarm.cli.main(['peer', '--help']))"
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "swarm: error: swarm's gradient averaging needs hivemind 1.1.12 (it uses private parts of it that other "
        "versions change), but hivemind 1.2.0 is installed; run: pip install hivemind==1.1.12"
    ]


def test_averaging_refuses_another_hivemind_on_import():
    done = _python("import hivemind; hivemind.__version__ = '1.2.0'; import swarm.averaging")
    assert done.returncode != 0
    assert "UnsupportedHivemind" in done.stderr and "pip install hivemind==1.1.12" in done.stderr, (
        done.stderr
    )
