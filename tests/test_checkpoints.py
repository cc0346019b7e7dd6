"""Stop every peer, restart them from their checkpoints: training resumes from the saved step."""

from __future__ import annotations

import signal

import pytest
import torch
from conftest import ask_peers

from swarm.coordinator.localswarm import finished

pytestmark = pytest.mark.swarm


def _state(endpoints, run_id):
    return ask_peers(endpoints, lambda client: client.get_state(run_id, timeout_s=30))


def test_restart_from_checkpoints_resumes_the_saved_step(local_swarm, tmp_path):
    run_id = "ckpt"

    def start_peers(tag):
        procs = [
            local_swarm.peer(
                f"{tag}-s{k}",
                k,
                "--preset",
                "tiny",
                "--target-batch-size",
                "16",
                "--checkpoint-dir",
                str(tmp_path / f"stage{k}"),
                "--checkpoint-every-steps",
                "2",
                "--no-rebalance",
                run_id=run_id,
                wait=False,
            )
            for k in (0, 1)
        ]
        return procs, [local_swarm.wait_ready(p) for p in procs]

    def train(tag, steps):
        trainer = local_swarm.trainer(
            f"{tag}-trainer", run_id=run_id, steps=steps, eval_every_steps=0, eval_batches=1
        )
        finished(trainer, timeout_s=300)

    procs, endpoints = start_peers("first")
    train("first", 6)  # 6 global batches of 16 samples: each stage steps 6 times
    before = _state(endpoints, run_id)
    assert [s.meta.step for s in before] == [6, 6]
    for proc in procs:
        proc.signal(signal.SIGTERM)  # drain writes a final checkpoint
        assert proc.popen.wait(timeout=60) == 0

    procs, endpoints = start_peers("second")
    for k, proc in enumerate(procs):
        proc.wait_for(rf"stage {k} resumed from checkpoint at step 6", timeout_s=5)
    after = _state(endpoints, run_id)
    for old, new in zip(before, after):
        assert new.meta.step == 6
        for name, tensor in old.tensors.items():
            assert torch.equal(tensor, new.tensors[name]), name  # exactly the saved parameters
    train("second", 2)
    assert [s.meta.step for s in _state(endpoints, run_id)] == [8, 8]


def test_export_then_generate_matches_the_swarm(local_swarm, tmp_path):
    import re
    import subprocess
    import sys

    from swarm.coordinator.export import load_exported
    from swarm.data import ByteCorpus, DataConfig

    run_id = "export"
    procs = [
        local_swarm.peer(
            f"exp-s{k}",
            k,
            "--preset",
            "tiny",
            "--target-batch-size",
            "16",
            "--no-rebalance",
            run_id=run_id,
            wait=False,
        )
        for k in (0, 1)
    ]
    for p in procs:
        local_swarm.wait_ready(p)
    trainer = local_swarm.trainer(
        "exp-trainer", run_id=run_id, steps=8, eval_every_steps=0, eval_batches=4
    )
    swarm_val = finished(trainer, timeout_s=300).val_loss

    out = tmp_path / "export"
    cli = [sys.executable, "-m", "swarm"]
    addr = f"@{local_swarm.addr_file}"
    done = subprocess.run(
        [*cli, "export", "--run-id", run_id, "--initial-peers", addr, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"stages at optimizer steps \[8, 8\]", done.stdout), done.stdout

    run, model = load_exported(str(out))
    corpus = ByteCorpus.load(DataConfig())
    with torch.no_grad():
        losses = [
            float(model.loss(b[:, :-1], b[:, 1:]))
            for b in corpus.val_batches(8, run.model.seq_len, 4)
        ]
    # Same parameters, same fixed validation batches, fp32 with codec none: equal up to summation order.
    assert sum(losses) / len(losses) == pytest.approx(swarm_val, rel=1e-3)

    text = subprocess.run(
        [*cli, "generate", "--checkpoint", str(out), "--prompt", "def ", "--max-new-tokens", "40"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("def ") and len(text.stdout.rstrip("\n")) >= 20
    bad = subprocess.run(
        [*cli, "generate", "--checkpoint", str(tmp_path / "missing.pt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "cannot read" in bad.stderr
