"""Convergence parity, short: 2 stages x 2 averaging peers (codec none, lockstep) against the same model trained in
one process with the same global batches, schedule and seed. (bench/convergence.py runs the longer version and
plots both curves.)"""

from __future__ import annotations

import pytest

from swarm.config import RunConfig
from swarm.data import ByteCorpus, DataConfig
from swarm.model import MODEL_PRESETS
from swarm.trainer.reference import train_reference

pytestmark = pytest.mark.slow

RUN = RunConfig(
    model=MODEL_PRESETS["tiny"], target_batch_size=64, lr=3e-3, warmup_steps=2, total_steps=8
)
PEER_FLAGS = [
    "--preset",
    "tiny",
    "--codec",
    "none",
    "--target-batch-size",
    str(RUN.target_batch_size),
    "--lr",
    str(RUN.lr),
    "--warmup-steps",
    str(RUN.warmup_steps),
    "--total-steps",
    str(RUN.total_steps),
    "--average",
    "--matchmaking-s",
    "0.5",
    "--heartbeat-s",
    "0.5",
    "--no-rebalance",
]
MICROBATCH, EVAL_BATCHES = 8, 4


def test_swarm_reaches_the_validation_loss_of_one_process(local_swarm):
    peers = [
        local_swarm.peer(f"s{stage}-{i}", stage, *PEER_FLAGS, run_id="parity", wait=False)
        for stage in range(2)
        for i in range(2)
    ]
    for proc in peers:
        local_swarm.wait_ready(proc)
    trainer = local_swarm.group.swarm(
        "trainer",
        "train",
        "--run-id",
        "parity",
        *local_swarm.initial_peers,
        "--steps",
        str(RUN.total_steps),
        "--microbatch-size",
        str(MICROBATCH),
        "--in-flight",
        "4",
        "--max-batches-ahead",
        "0",
        "--seed",
        "0",
        "--eval-every-steps",
        "0",
        "--eval-batches",
        str(EVAL_BATCHES),
        "--log-every-s",
        "0",
    )
    assert trainer.popen.wait(timeout=300) == 0, trainer.log_path.read_text()[-3000:]
    first_loss = float(trainer.wait_for(r"^step 1/\d+ \| loss ([\d.]+)", timeout_s=5).group(1))
    swarm_val = float(trainer.wait_for(r"validation loss ([\d.]+)", timeout_s=5).group(1))

    reference = train_reference(
        RUN,
        ByteCorpus.load(DataConfig()),
        steps=RUN.total_steps,
        microbatch_size=MICROBATCH,
        seed=0,
        eval_batches=EVAL_BATCHES,
    )
    one_process_val = reference.val_loss
    # The first batch runs on the same initial parameters and data in both: the same loss (printed to 3 decimals).
    assert first_loss == pytest.approx(reference.losses[0], abs=1e-3)
    gap = abs(swarm_val - one_process_val) / one_process_val
    print(
        f"validation loss after {RUN.total_steps} batches: swarm {swarm_val:.4f}, one process "
        f"{one_process_val:.4f} ({gap:.2%} apart)"
    )
    assert gap <= 0.03
