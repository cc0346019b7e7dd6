"""What TLS costs a training swarm: the same 2-stage swarm trained by trainers of a run whose peers serve TLS (the
default) and of one whose peers serve ``--plaintext``, in alternating runs against the same peers.

Run from the repository root:  .venv/bin/python bench/tls_swarm.py [--steps 15] [--rounds 2]
Writes bench/results/tls_swarm.md.

The swarm: tiny preset, 2 stages x 1 peer per run (``--threads 1``, codec int8, target batch 32, no averaging),
loopback processes; both runs' peers stay up, idle while the other run trains. Each round runs one trainer per mode,
in alternating order; tokens/s comes from each trainer's summary. Callers are authenticated in both runs (tokens),
so the ratio is what encryption costs a step. See bench/tls_cost.py for the cost per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402

from swarm.coordinator.localswarm import LocalSwarm, finished, wait_ready  # noqa: E402

MODES = {"TLS": [], "plaintext": ["--plaintext"]}
PEER_FLAGS = [
    "--preset",
    "tiny",
    "--codec",
    "int8",
    "--target-batch-size",
    "32",
    "--no-average",
    "--no-rebalance",
]


def run(steps: int, rounds: int, workdir: Path) -> list[dict]:
    out = []
    with LocalSwarm(workdir) as swarm:
        procs = [
            swarm.peer(
                f"{mode}-s{stage}", stage, *PEER_FLAGS, *flags, run_id=f"tls-{mode}", wait=False
            )
            for mode, flags in MODES.items()
            for stage in range(2)
        ]
        for proc in procs:
            wait_ready(proc)
        for round_ in range(rounds):
            # TLS first in even rounds, plaintext first in odd ones: a drift in load hits both alike
            for mode in list(MODES)[:: 1 if round_ % 2 == 0 else -1]:
                trainer = swarm.trainer(
                    f"trainer-r{round_}-{mode}",
                    run_id=f"tls-{mode}",
                    steps=steps,
                    microbatch_size=8,
                    in_flight=4,
                    eval_every_steps=0,
                    eval_batches=1,
                    log_every_s=30,
                )
                summary = finished(trainer, timeout_s=1800)
                out.append(dict(round=round_, mode=mode, tokens_per_s=summary.tokens_per_s))
                print(f"round {round_} {mode}: {summary.tokens_per_s:,.0f} tokens/s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="global batches per trainer run")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each mode, alternating")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "tls_swarm.md")
    args = parser.parse_args()
    info = RunInfo(
        command=".venv/bin/python bench/tls_swarm.py" + "".join(f" {a}" for a in sys.argv[1:])
    )
    workdir = Path(tempfile.mkdtemp(prefix="swarm-tls-"))
    print(f"logs in {workdir}", flush=True)
    results = run(args.steps, args.rounds, workdir)
    info.finish()
    plain = {r["round"]: r["tokens_per_s"] for r in results if r["mode"] == "plaintext"}
    rows = [
        [
            r["round"],
            r["mode"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / plain[r['round']]:.3f}",
        ]
        for r in results
    ]
    ratios = [r["tokens_per_s"] / plain[r["round"]] for r in results if r["mode"] == "TLS"]
    info.extra.append(
        f"tiny preset, 2 stages x 1 peer per run (`--threads 1`, codec int8, target batch 32, no averaging) on "
        f"loopback; trainers of {args.steps} global batches, microbatch 8, 4 in flight"
    )
    body = (
        markdown_table(["round", "peers serve", "tokens/s", "÷ plaintext, same round"], rows)
        + f"\n\n- TLS: median tokens/s ratio {statistics.median(ratios):.3f} over {len(ratios)} rounds"
    )
    path = write_result(args.out, title="What TLS costs a training swarm", info=info, body=body)
    print("\n" + body + f"\n\nwritten to {path}")


if __name__ == "__main__":
    main()
