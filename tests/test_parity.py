"""Convergence parity, short: 2 stages x 2 averaging peers (codec none) against the same model trained in one process
with the same global batches, schedule and seed: in lockstep, and one batch ahead (the default: each batch pinned to
the parameters of the step before its predecessor's, which the one-process run trains with ``delay_steps=1``).
(bench/convergence.py runs the longer version and plots the curves.)"""

from __future__ import annotations

import re

import pytest

from swarm.config import RunConfig
from swarm.coordinator.localswarm import finished, read_metrics
from swarm.data import ByteCorpus, DataConfig
from swarm.model import MODEL_PRESETS
from swarm.trainer.reference import train_reference

pytestmark = pytest.mark.swarm

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


# What a replica logs when its run leaves the one-process trajectory: any warning of the stage optimizer
# (swarm/averaging/optimizer.py: it missed its stage's all-reduce or got part of it, fell behind, loaded its peers'
# state) or of hivemind's averaging (a groupmate's part timed out). The README counts 1 to 4 such repairs per
# averaging run on a loaded machine. A departure that logs nothing is the bug this test exists to catch: one
# replica stepping on its own gradients unseen ended a run 0.2% from one process.
REPAIRS = r"WARN(ING)? swarm\.averaging|\[WARN\] \[hivemind\.averaging"
# Relative validation-loss gap to one process (full precision, from the metrics file). Measured on 8 batches (2 x 2
# averaging peers, lockstep): below 0.0005% on a run without a repair (3.6185 both), and 0.01% on 2 earlier runs,
# read from the summary line's 3 decimals (within its rounding, 0.014%); fp32 summation order is the only
# difference. Two runs that ended 0.18% and 0.2% apart had a replica step alone unseen (fixed:
# hivemind_private.begin_global_step). What the bound must tell apart: per-stage against exact global clipping moves
# the same 8 batches by 0.26% (train_reference with clipping="stage" vs "global": 3.6185 vs 3.6091); replicas
# clipping each stage to max_grad_norm instead of max_grad_norm / sqrt(2) end 0.56% apart. 0.05% is 100x the clean
# gap and 5x below the smaller of those.
CLEAN_GAP = 0.0005
# A run with a repair trains some stage on fewer than the global batch once or more; the bound is then the
# one the long run measured with a repaired partial all-reduce (0.88% after 60 batches, bench/results/
# convergence.md), still 15x below what stale parameters cost (pipelined, 15%). Such a run cannot tell the
# clipping errors above from a repair's effect; it says so in the printed line (the repairs it saw), and the
# next clean run catches them.
REPAIRED_GAP = 0.01


@pytest.mark.parametrize("ahead", [0, 1], ids=["lockstep", "one-batch-ahead"])
def test_swarm_reaches_the_validation_loss_of_one_process(local_swarm, ahead):
    peers = [
        local_swarm.peer(f"s{stage}-{i}", stage, *PEER_FLAGS, run_id="parity", wait=False)
        for stage in range(2)
        for i in range(2)
    ]
    for proc in peers:
        local_swarm.wait_ready(proc)
    trainer = local_swarm.trainer(
        "trainer",
        run_id="parity",
        steps=RUN.total_steps,
        microbatch_size=MICROBATCH,
        in_flight=4,
        max_batches_ahead=ahead,
        seed=0,
        eval_every_steps=0,
        eval_batches=EVAL_BATCHES,
        log_every_s=0,
        metrics_path=local_swarm.group.workdir / "metrics.jsonl",
    )
    finished(trainer, timeout_s=300)
    swarm_val = read_metrics(local_swarm.group.workdir / "metrics.jsonl").validations[-1][
        "val_loss"
    ]
    first_loss = float(trainer.wait_for(r"^step 1/\d+ \| loss ([\d.]+)", timeout_s=5).group(1))
    repairs = [f"{p.name}: {line}" for p in peers for line in p.lines if re.search(REPAIRS, line)]

    reference = train_reference(
        RUN,
        ByteCorpus.load(DataConfig()),
        steps=RUN.total_steps,
        microbatch_size=MICROBATCH,
        seed=0,
        eval_batches=EVAL_BATCHES,
        delay_steps=ahead,
    )
    one_process_val = reference.val_loss
    # The first batch runs on the same initial parameters and data in both: the same loss (printed to 3 decimals).
    assert first_loss == pytest.approx(reference.losses[0], abs=1e-3)
    gap = abs(swarm_val - one_process_val) / one_process_val
    print(
        f"validation loss after {RUN.total_steps} batches: swarm {swarm_val:.4f}, one process "
        f"{one_process_val:.4f} ({gap:.3%} apart, {len(repairs)} repairs)"
    )
    assert gap <= (REPAIRED_GAP if repairs else CLEAN_GAP), "\n".join(repairs) or "no repair logged"
