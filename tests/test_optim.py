"""Stage optimizers without networking (schedule, AdamW groups, the single-process reference), and the fence
around hivemind's private API: swarm.optim imports no hivemind; the fence refuses any other hivemind version."""

from __future__ import annotations

import subprocess
import sys

import pytest

from swarm.config import RunConfig
from swarm.data import ByteCorpus
from swarm.model import ModelConfig, build_stage
from swarm.optim import adamw_param_groups, learning_rate
from swarm.trainer.reference import train_reference

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
    result = train_reference(
        run,
        corpus,
        steps=6,
        microbatch_size=4,
        eval_every_steps=3,
        eval_batches=2,
        on_step=lambda step, loss: seen.append(step),
    )
    assert len(result.losses) == 6 and seen == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in result.val_losses] == [3, 6]
    assert result.losses[-1] < result.losses[0]
    assert result.tokens == 6 * 8 * SMALL.seq_len
    assert result.tokens_per_s > 0 and result.train_time_s > 0
    again = train_reference(run, corpus, steps=6, microbatch_size=4, eval_batches=0)
    assert again.losses == pytest.approx(result.losses, rel=1e-5) and again.val_losses == []
    stopped = train_reference(
        run, corpus, steps=6, microbatch_size=4, eval_batches=2, on_step=lambda s, _: s == 2
    )
    assert stopped.losses == pytest.approx(result.losses[:2], rel=1e-5)
    assert [step for step, _ in stopped.val_losses] == [2]


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
