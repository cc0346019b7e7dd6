"""Training quality per compression scheme in one process, over several seeds: the swarm's twin with its wire.

Run from the repository root:
    .venv/bin/python bench/quality_twin.py --schemes int4+bn26+tok,int8 --seeds 0,1,2 [--steps 150] [--jobs 2]
Writes bench/results/quality_twin.md (table + provenance).

Each run is ``swarm.trainer.reference.train_reference`` with ``wire=True``: the same model init, data order,
global batches, schedule and per-stage optimizers as a swarm run of ``bench/quality.py`` (2 stages x 1 peer, one
microbatch in flight), and each cut's activations and gradients round-trip the scheme's codecs as they cross the
swarm's network. What it leaves out is the network itself: no processes, no DHT, so a run costs its compute alone
and ``--jobs`` of them share the cores. With codec none it reproduces the swarm's loss exactly (2.4846 on tiny, 150
steps, seed 0); with a lossy codec the two agree to within float noise, which a lossy run amplifies (quantized
training is chaotic: int4+bn26+tok gave 2.5987 here and 2.5728 in the swarm, same seed). So schemes are compared
by their gap to ``none`` of the same data seed, averaged over seeds: the table's mean, not any one seed, is the
measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402
from quality import QualityConfig, Scheme  # noqa: E402

from swarm.model import MODEL_PRESETS  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Job:
    scheme: str
    seed: int
    preset: str
    steps: int


@dataclasses.dataclass(frozen=True)
class Outcome:
    job: Job
    val_curve: list[tuple[int, float]]  # (global batches, validation loss)
    wall_s: float

    @property
    def final_val(self) -> float:
        return self.val_curve[-1][1]


def run_job(job: Job) -> Outcome:
    """One scheme at one seed, as ``bench/quality.py`` would train it (its QualityConfig defaults)."""
    import torch

    from swarm.config import RunConfig
    from swarm.data import ByteCorpus, DataConfig
    from swarm.trainer.reference import train_reference

    torch.set_num_threads(
        1
    )  # as each peer of bench/quality.py (--threads 1); --jobs share the cores
    cfg = QualityConfig(steps=job.steps, preset=job.preset)
    scheme = Scheme.parse(job.scheme)
    if scheme.subspace_dim is not None:
        raise ValueError(f"scheme {job.scheme!r}: the twin does not build the subspace cut")
    model = dataclasses.replace(
        MODEL_PRESETS[job.preset],
        bottleneck_dim=scheme.bottleneck_dim,
        bottleneck_init=scheme.bottleneck_init,
        bottleneck_tokens=scheme.bottleneck_tokens,
    )
    run = RunConfig(
        model=model,
        codec=scheme.codec,
        grad_codec=scheme.grad_codec,
        target_batch_size=cfg.target_batch_size,
        lr=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        total_steps=cfg.steps,
    )
    started = time.monotonic()
    result = train_reference(
        run,
        ByteCorpus.load(DataConfig()),
        steps=cfg.steps,
        microbatch_size=cfg.microbatch_size,
        seed=job.seed,
        eval_batches=cfg.eval_batches,
        eval_every_steps=cfg.eval_every_steps,
        wire=True,
    )
    return Outcome(job, result.val_losses, time.monotonic() - started)


def ratio(scheme: str, preset: str) -> float:
    """Fewer activation bytes than fp32, per microbatch of bench/quality.py's shape."""
    config = MODEL_PRESETS[preset]
    values = QualityConfig().microbatch_size * config.seq_len * config.d_model
    return 4.0 / Scheme.parse(scheme).bytes_per_fp32_value(config.d_model, values)


def report(outcomes: list[Outcome], schemes: list[str], seeds: list[int], preset: str) -> str:
    val = {(o.job.scheme, o.job.seed): o.final_val for o in outcomes}
    headers = [
        "scheme",
        "x fewer than fp32",
        *(f"seed {s}: val (gap)" for s in seeds),
        "mean gap vs none",
        "spread of the gaps",
    ]
    rows = []
    for scheme in ["none", *schemes]:
        cells, gaps = [], []
        for seed in seeds:
            loss, base = val.get((scheme, seed)), val.get(("none", seed))
            if loss is None or base is None:
                cells.append("-")
                continue
            gap = loss / base - 1
            gaps.append(gap)
            cells.append(f"{loss:.4f}" if scheme == "none" else f"{loss:.4f} ({100 * gap:+.2f}%)")
        mean = f"**{100 * statistics.fmean(gaps):+.2f}%**" if gaps and scheme != "none" else ""
        spread = (
            f"{100 * (max(gaps) - min(gaps)):.2f} points"
            if len(gaps) > 1 and scheme != "none"
            else ""
        )
        rows.append([scheme, f"{ratio(scheme, preset):.1f}", *cells, mean, spread])
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--schemes",
        default="int8",
        help="comma-separated schemes in bench/quality.py's syntax (CODEC[/GRAD][+bnN[+orth|pca|...][+tok]]); "
        "none is always run as the reference",
    )
    parser.add_argument("--seeds", default="0,1,2", help="trainer data-order seeds")
    parser.add_argument("--steps", type=int, default=150, help="global batches (32 samples)")
    parser.add_argument("--preset", default="tiny", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "quality_twin.md")
    args = parser.parse_args()
    schemes = [s for s in args.schemes.split(",") if s and s != "none"]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    for scheme in schemes:  # bad flags fail here, before any run
        Scheme.parse(scheme)
    info = RunInfo(
        command=".venv/bin/python bench/quality_twin.py" + "".join(f" {a}" for a in sys.argv[1:])
    )
    cfg = QualityConfig(steps=args.steps, preset=args.preset)
    info.extra += [
        f"model preset {args.preset}, 2 stages in one process (train_reference with wire=True), {args.jobs} runs at "
        f"once with 1 thread each; {cfg.steps} global batches of {cfg.samples_per_step} samples; microbatch "
        f"{cfg.microbatch_size}; lr {cfg.lr} with {cfg.warmup_steps} warmup steps and cosine decay; validation on "
        f"{cfg.eval_batches} fixed batches; data-order seeds {', '.join(map(str, seeds))}",
    ]
    jobs = [Job(s, seed, args.preset, args.steps) for seed in seeds for s in ["none", *schemes]]
    outcomes: list[Outcome] = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for outcome in pool.map(run_job, jobs):
            outcomes.append(outcome)
            print(
                f"{outcome.job.scheme} seed {outcome.job.seed}: {outcome.final_val:.4f} "
                f"({outcome.wall_s:.0f}s)",
                flush=True,
            )
            info.finish()
            partial = len(outcomes) < len(jobs)
            body = (
                f"**Partial: {len(outcomes)} of {len(jobs)} runs so far.**\n\n" if partial else ""
            ) + report(outcomes, schemes, seeds, args.preset)
            write_result(
                args.out,
                title="Validation loss per compression scheme, one process, paired by seed",
                info=info,
                body=body,
            )
    print("\n" + report(outcomes, schemes, seeds, args.preset) + f"\n\nwritten to {args.out}")


if __name__ == "__main__":
    main()
