"""What a replica's handed-over samples cost the model, by how many steps late they arrive: the bound behind
``HAND_OVER_STEPS`` (swarm/averaging/optimizer.py).

Run from the repository root:
    .venv/bin/python bench/stale_handover.py [--lates 1,4,16,64] [--every 4] [--seeds 0,1,2] [--steps 150] [--jobs 2]
Writes bench/results/stale_handover.md (table + provenance).

A replica that misses its stage's all-reduce group (frozen, slow, joined late) holds its samples of that batch; its
peers step on the rest of the batch. It then either hands its gradient sums over into a later step of the stage,
``late`` steps after the batch they were computed for, weighted by their samples beside that step's own batch, or
leaves them out (lost: the model never sees those samples). This measures both in one process, on the swarm's twin
(the model, data order, schedule and per-stage optimizers of ``swarm.trainer.reference``, as bench/quality_twin.py
runs it, wire codec none): every ``--every``-th global batch, ``--held`` of its samples are held back and the step
averages the rest; then they are either handed over into the step ``late`` batches on, or dropped. ``exact`` holds
nothing back. Each policy's final validation loss is compared with ``exact`` of the same data seed, then averaged
over seeds (a perturbed run diverges chaotically from its twin; one seed is noise).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402
from quality import QualityConfig  # noqa: E402

from swarm.model import MODEL_PRESETS  # noqa: E402

EXACT, DROP = "exact", "drop"


@dataclasses.dataclass(frozen=True)
class Job:
    policy: str  # EXACT, DROP or the number of steps late, as text
    seed: int
    preset: str
    steps: int
    every: int
    held: int


@dataclasses.dataclass(frozen=True)
class Outcome:
    job: Job
    val_curve: list[tuple[int, float]]
    handed: int  # samples handed over
    dropped: int  # samples left out (held back and never applied)
    wall_s: float


def run_job(job: Job) -> Outcome:
    """Train as train_reference does (lockstep, stage clipping), holding back ``job.held`` samples of every
    ``job.every``-th batch as the policy says."""
    import torch

    from swarm.config import RunConfig
    from swarm.data import ByteCorpus, DataConfig
    from swarm.model import build_full_model, evaluate
    from swarm.optim import LocalStageOptimizer

    torch.set_num_threads(1)
    cfg = QualityConfig(steps=job.steps, preset=job.preset)
    run = RunConfig(
        model=MODEL_PRESETS[job.preset],
        target_batch_size=cfg.target_batch_size,
        lr=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        total_steps=cfg.steps,
    )
    corpus = ByteCorpus.load(DataConfig())
    model = build_full_model(run.model)
    # each step's whole sums go in at once and the optimizer steps on their mean, whatever their samples (a stage's
    # all-reduce over the replicas that took part): a target of one sample
    one = dataclasses.replace(run, target_batch_size=1)
    optimizers = [LocalStageOptimizer(stage, one) for stage in model.stages]
    stages = [list(stage.parameters()) for stage in model.stages]
    generator = torch.Generator().manual_seed(job.seed)
    mb, seq_len = cfg.microbatch_size, run.model.seq_len
    per_step, held_microbatches = math.ceil(run.target_batch_size / mb), job.held // mb
    val_batches = corpus.val_batches(mb, seq_len, cfg.eval_batches)
    late = None if job.policy in (EXACT, DROP) else int(job.policy)
    # batch the held sums are due at -> (per stage, per parameter gradient sums; samples)
    due: dict[int, tuple[list[list[torch.Tensor]], int]] = {}
    curve, handed, dropped, started = [], 0, 0, time.monotonic()

    def take_grads() -> list[list[torch.Tensor]]:
        grads = [[p.grad.clone() for p in params] for params in stages]
        model.zero_grad(set_to_none=True)
        return grads

    for step in range(job.steps):
        hold = job.policy != EXACT and step % job.every == job.every - 1
        held, own_samples, held_samples = None, 0, 0
        for i in range(per_step):
            tokens = corpus.sample("train", mb, seq_len, generator)
            n = tokens.shape[0]
            (model.loss(tokens[:, :-1], tokens[:, 1:]) * n).backward()
            if hold and i == held_microbatches - 1:
                held, held_samples = take_grads(), held_microbatches * mb
            elif not (hold and i < held_microbatches):
                own_samples += n
        own = take_grads()
        samples = own_samples
        if step in due:  # samples of an earlier batch, handed over into this step
            late_grads, n = due.pop(step)
            for stage_own, stage_late in zip(own, late_grads):
                for g, h in zip(stage_own, stage_late):
                    g.add_(h)
            samples += n
            handed += n
        if held is not None:
            if late is None or step + late >= job.steps:
                dropped += held_samples
            else:
                due[step + late] = (held, held_samples)
        for optimizer, grads in zip(optimizers, own):
            optimizer.accumulate(grads, samples)
        if (step + 1) % cfg.eval_every_steps == 0 or step + 1 == job.steps:
            curve.append((step + 1, evaluate(model, val_batches)))
    return Outcome(job, curve, handed, dropped, time.monotonic() - started)


def report(outcomes: list[Outcome], policies: list[str], seeds: list[int]) -> str:
    val = {(o.job.policy, o.job.seed): o.val_curve[-1][1] for o in outcomes}
    moved = {o.job.policy: (o.handed, o.dropped) for o in outcomes}
    headers = [
        "policy",
        "samples handed over / left out (per run)",
        *(f"seed {s}: val (gap)" for s in seeds),
        "mean gap vs exact",
    ]
    rows = []
    for policy in policies:
        cells, gaps = [], []
        for seed in seeds:
            loss, base = val.get((policy, seed)), val.get((EXACT, seed))
            if loss is None or base is None:
                cells.append("-")
                continue
            gaps.append(loss / base - 1)
            cells.append(
                f"{loss:.4f}" if policy == EXACT else f"{loss:.4f} ({100 * gaps[-1]:+.2f}%)"
            )
        label = {EXACT: "exact (nothing held back)", DROP: "left out (lost)"}.get(
            policy, f"handed over {policy} step(s) late"
        )
        handed, dropped = moved.get(policy, (0, 0))
        mean = f"**{100 * statistics.fmean(gaps):+.2f}%**" if gaps and policy != EXACT else ""
        rows.append([label, f"{handed} / {dropped}", *cells, mean])
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lates", default="1,4,16,64", help="steps late to hand over at")
    parser.add_argument("--every", type=int, default=4, help="hold back samples of every Nth batch")
    parser.add_argument(
        "--held", type=int, default=16, help="samples held back (whole microbatches of 8)"
    )
    parser.add_argument("--seeds", default="0,1,2", help="trainer data-order seeds")
    parser.add_argument("--steps", type=int, default=150, help="global batches (32 samples)")
    parser.add_argument("--preset", default="tiny", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "stale_handover.md")
    args = parser.parse_args()
    lates = [int(s) for s in args.lates.split(",") if s]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    cfg = QualityConfig(steps=args.steps, preset=args.preset)
    if (
        any(k < 1 for k in lates)
        or args.every < 1
        or not 0 < args.held < cfg.target_batch_size
        or args.held % cfg.microbatch_size
    ):
        parser.error(
            f"--lates must be >= 1, --every >= 1, and --held a multiple of {cfg.microbatch_size} "
            f"below the batch of {cfg.target_batch_size}"
        )
    policies = [EXACT, DROP, *map(str, lates)]
    info = RunInfo(
        command=".venv/bin/python bench/stale_handover.py" + "".join(f" {a}" for a in sys.argv[1:])
    )
    info.extra += [
        f"model preset {args.preset}, 2 stages in one process (the swarm's twin, lockstep, codec none), "
        f"{args.jobs} runs at once with 1 thread each; {cfg.steps} global batches of {cfg.samples_per_step} "
        f"samples in microbatches of {cfg.microbatch_size}; lr {cfg.lr}, {cfg.warmup_steps} warmup steps, cosine "
        f"decay; validation on {cfg.eval_batches} fixed batches; {args.held} samples held back of every "
        f"{args.every}th batch; data-order seeds {', '.join(map(str, seeds))}",
    ]
    jobs = [
        Job(p, seed, args.preset, args.steps, args.every, args.held)
        for seed in seeds
        for p in policies
    ]
    outcomes: list[Outcome] = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for outcome in pool.map(run_job, jobs):
            outcomes.append(outcome)
            print(
                f"{outcome.job.policy} seed {outcome.job.seed}: {outcome.val_curve[-1][1]:.4f} "
                f"({outcome.wall_s:.0f}s)",
                flush=True,
            )
    info.finish()
    body = report(outcomes, policies, seeds)
    write_result(
        args.out,
        title="What handed-over samples cost, by how late they arrive",
        info=info,
        body=body,
    )
    print("\n" + body + f"\n\nwritten to {args.out}")


if __name__ == "__main__":
    main()
