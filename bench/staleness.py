"""What one step of staleness costs in validation loss, in one process: the schedule of ``--max-batches-ahead 1``.

Run from the repository root:
    .venv/bin/python bench/staleness.py [--steps 60] [--lrs 3e-3,1e-3,3e-4] [--predict 0,1]
Writes bench/results/staleness.md (table + provenance).

Each run trains the convergence benchmark's model and data (tiny, 2 stages, 64-sample batches of 8, AdamW with
the stages' betas, 10 warmup steps then cosine decay, trainer seed 0) as ``swarm.trainer.reference`` does, with
each global batch's gradient applied ``delay`` batches after it was computed: what averaging stages train when the
trainer streams the next batch while they all-reduce the last (``--max-batches-ahead``). With ``--predict p``
(delay 1 only) each batch computes its gradient on the parameters moved ``p`` times the last step's change
further, a guess at the step it is one batch late for (weight prediction), and the gradient is applied to the
real parameters; ``p`` 0 is plain staleness. Lockstep (delay 0) is the reference of each learning rate.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402

from swarm.config import RunConfig  # noqa: E402
from swarm.data import ByteCorpus, DataConfig  # noqa: E402
from swarm.model import MODEL_PRESETS, build_full_model, evaluate  # noqa: E402
from swarm.optim import LocalStageOptimizer  # noqa: E402

BATCH, MICROBATCH, WARMUP, EVAL_BATCHES, EVAL_EVERY = 64, 8, 10, 8, 10


def train(
    corpus: ByteCorpus, *, steps: int, lr: float, delay: int, predict: float
) -> list[tuple[int, float]]:
    """Validation loss every EVAL_EVERY batches (and after the last) of one run."""
    run = RunConfig(
        model=MODEL_PRESETS["tiny"],
        target_batch_size=BATCH,
        lr=lr,
        warmup_steps=WARMUP,
        total_steps=steps,
    )
    model = build_full_model(run.model)
    optimizers = [LocalStageOptimizer(stage, run) for stage in model.stages]
    params = [p for stage in model.stages for p in stage.parameters()]
    generator = torch.Generator().manual_seed(0)
    val = corpus.val_batches(MICROBATCH, run.model.seq_len, EVAL_BATCHES)
    per_step = math.ceil(BATCH / MICROBATCH)
    unapplied: deque[list[tuple[list, int]]] = deque()
    last_change: list[torch.Tensor] | None = None

    def apply_oldest() -> None:
        nonlocal last_change
        before = [p.detach().clone() for p in params]
        for optimizer, (grads, n) in zip(optimizers, unapplied.popleft()):
            optimizer.accumulate(grads, n)
        last_change = [p.detach() - b for p, b in zip(params, before)]

    def shift(sign: float) -> None:
        if predict and last_change is not None:
            with torch.no_grad():
                for p, change in zip(params, last_change):
                    p.add_(change, alpha=sign * predict)

    curve = []
    for step in range(1, steps + 1):
        shift(+1.0)
        for _ in range(per_step):
            tokens = corpus.sample("train", MICROBATCH, run.model.seq_len, generator)
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
            (loss * tokens.shape[0]).backward()
        shift(-1.0)
        batch = []
        for stage in model.stages:
            batch.append(([p.grad for p in stage.parameters()], per_step * MICROBATCH))
            for p in stage.parameters():
                p.grad = None
        unapplied.append(batch)
        while len(unapplied) > delay or (step == steps and unapplied):
            apply_oldest()
        if step % EVAL_EVERY == 0 or step == steps:
            curve.append((step, evaluate(model, val)))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="global batches of 64 samples")
    parser.add_argument("--lrs", default="3e-3,1e-3,3e-4", help="peak learning rates")
    parser.add_argument("--predict", default="0,1", help="weight-prediction factors at delay 1")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "staleness.md")
    args = parser.parse_args()
    info = RunInfo(
        command=".venv/bin/python bench/staleness.py" + "".join(f" {a}" for a in sys.argv[1:])
    )
    torch.set_num_threads(1)
    corpus = ByteCorpus.load(DataConfig())
    rows = []
    for lr in (float(x) for x in args.lrs.split(",")):
        lockstep = train(corpus, steps=args.steps, lr=lr, delay=0, predict=0.0)
        rows.append((lr, "lockstep", lockstep, lockstep[-1][1]))
        print(f"lr {lr:g} lockstep: {lockstep[-1][1]:.4f}", flush=True)
        for predict in (float(x) for x in args.predict.split(",")):
            label = "1 batch late" + (f", predicted x{predict:g}" if predict else "")
            curve = train(corpus, steps=args.steps, lr=lr, delay=1, predict=predict)
            rows.append((lr, label, curve, lockstep[-1][1]))
            print(f"lr {lr:g} {label}: {curve[-1][1]:.4f}", flush=True)
    info.finish()
    info.extra.append(
        f"tiny preset, 2 stages in one process (1 torch thread); {args.steps} global batches of {BATCH} samples "
        f"(microbatch {MICROBATCH}); {WARMUP} warmup steps, cosine decay to the last batch; trainer seed 0; "
        f"validation on {EVAL_BATCHES} fixed batches"
    )
    table = markdown_table(
        [
            "peak lr",
            "schedule",
            "final validation loss",
            "vs lockstep",
            "validation loss every 10 batches",
        ],
        [
            (
                f"{lr:g}",
                label,
                f"{curve[-1][1]:.4f}",
                f"{(curve[-1][1] - base) / base:+.2%}",
                ", ".join(f"{s}: {v:.3f}" for s, v in curve),
            )
            for lr, label, curve, base in rows
        ],
        right_align_from=2,
    )
    path = write_result(
        args.out, title="What one step of staleness costs (one process)", info=info, body=table
    )
    print(f"\n{table}\n\nwritten to {path}")


if __name__ == "__main__":
    main()
