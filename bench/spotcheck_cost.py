"""What spot-checks cost: the same swarm trained with the trainer's ``--spot-check-share`` at 0 and at its default
(0.05), and at 0.2 to show how the cost scales, in alternating runs against the same peers.

Run from the repository root:  .venv/bin/python bench/spotcheck_cost.py [--steps 30] [--rounds 2]
Writes bench/results/spotcheck_cost.md.

The swarm: tiny preset, 2 stages x 3 peers that average gradients (spot-checks compare only replicas at the same
step and parameters, which averaging keeps equal; three replicas let a third decide a mismatch), codec int8, on
loopback processes. Each round runs one trainer per share, in the order 0, default, 0.2 (so load drifts hit every
share alike); tokens/s comes from each trainer's summary, and each trainer's log gives its spot-check counts.
The cost is the ratio of tokens/s with checks to tokens/s without, per round (the same peers, minutes apart).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402

from swarm.coordinator.localswarm import LocalSwarm, finished, wait_ready  # noqa: E402
from swarm.trainer.config import PipelineConfig  # noqa: E402

DEFAULT_SHARE = PipelineConfig().spot_check_share
SHARES = (0.0, DEFAULT_SHARE, 0.2)
PEERS_PER_STAGE = 3
SPOT_LINE = re.compile(
    r"spot-checks: (\d+) compared \((\d+) agreed, (\d+) mismatched\), (\d+) inconclusive; "
    r"banned for the run: (.+)$"
)
PEER_FLAGS = [
    "--preset",
    "tiny",
    "--codec",
    "int8",
    "--target-batch-size",
    "32",
    "--average",
    "--matchmaking-s",
    "0.5",
    "--no-rebalance",
]


def run(steps: int, rounds: int, workdir: Path) -> list[dict]:
    out = []
    with LocalSwarm(workdir) as swarm:
        peers = [
            swarm.peer(f"s{stage}-{i}", stage, *PEER_FLAGS, run_id="spot", wait=False)
            for stage in range(2)
            for i in range(PEERS_PER_STAGE)
        ]
        for proc in peers:
            wait_ready(proc)
        for round_ in range(rounds):
            for share in SHARES:
                name = f"trainer-r{round_}-{share}"
                trainer = swarm.trainer(
                    name,
                    run_id="spot",
                    steps=steps,
                    microbatch_size=8,
                    in_flight=4,
                    eval_every_steps=0,
                    eval_batches=1,
                    log_every_s=30,
                    spot_check_share=share,
                )
                summary = finished(trainer, timeout_s=1800)
                found = trainer.wait_for(SPOT_LINE.pattern, timeout_s=5)
                compared, agreed, mismatched, inconclusive = map(int, found.groups()[:4])
                out.append(
                    dict(
                        round=round_,
                        share=share,
                        tokens_per_s=summary.tokens_per_s,
                        compared=compared,
                        agreed=agreed,
                        mismatched=mismatched,
                        inconclusive=inconclusive,
                        banned=found.group(5),
                    )
                )
                print(
                    f"round {round_} share {share}: {summary.tokens_per_s:,.0f} tokens/s, {compared} compared "
                    f"({mismatched} mismatched), {inconclusive} inconclusive, banned: {found.group(5)}",
                    flush=True,
                )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="global batches per trainer run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each share, alternating")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "spotcheck_cost.md")
    args = parser.parse_args()
    info = RunInfo(
        command=".venv/bin/python bench/spotcheck_cost.py" + "".join(f" {a}" for a in sys.argv[1:])
    )
    workdir = Path(tempfile.mkdtemp(prefix="swarm-spotcheck-"))
    print(f"logs in {workdir}", flush=True)
    results = run(args.steps, args.rounds, workdir)
    info.finish()
    baseline = {r["round"]: r["tokens_per_s"] for r in results if r["share"] == 0}
    rows = [
        [
            r["round"],
            f"{r['share']:g}" + (" (default)" if r["share"] == DEFAULT_SHARE else ""),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / baseline[r['round']]:.3f}",
            r["compared"],
            r["mismatched"],
            r["inconclusive"],
            r["banned"],
        ]
        for r in results
    ]
    table = markdown_table(
        [
            "round",
            "spot-check share",
            "tokens/s",
            "÷ share 0, same round",
            "calls compared",
            "mismatched",
            "inconclusive",
            "banned",
        ],
        rows,
    )
    summary = []
    for share in SHARES[1:]:
        ratios = [r["tokens_per_s"] / baseline[r["round"]] for r in results if r["share"] == share]
        summary.append(
            f"- share {share:g}: median tokens/s ratio {statistics.median(ratios):.3f} over {len(ratios)} rounds"
        )
    info.extra += [
        f"tiny preset, 2 stages x {PEERS_PER_STAGE} averaging peers (`--threads 1`, codec int8, target batch 32, "
        f"`--matchmaking-s 0.5`) on loopback; trainers of {args.steps} global batches, microbatch 8, 4 in flight",
    ]
    body = table + "\n\n" + "\n".join(summary)
    path = write_result(args.out, title="What spot-checks cost", info=info, body=body)
    print("\n" + body + f"\n\nwritten to {path}")


if __name__ == "__main__":
    main()
