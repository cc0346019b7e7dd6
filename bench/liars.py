"""Liars against an honest swarm: the same workload trained twice, once by honest peers only and once with two
liars among them, on separate processes over loopback (real DHT, real gRPC with TLS, averaging replicas).

Swarm: stage 0 served by three replicas, stage 1 by two, every one averaging (so replicas hold equal parameters
and spot-checks can compare them). In the liars' run one stage-0 replica answers every forward with its output
times 1.5 (``--lie-output-scale``: finite, well shaped, the reply checks pass it; spot-checks catch it) and one
stage-1 replica returns input gradients a million times too large (``--lie-gradient-scale``: the trainer's
gradient bound catches it). The honest run has the same five peers, all honest. Both trainers spot-check a
quarter of their forward calls and bound gradients at 1000x the stage's recent lower quartile
(``--max-gradient-ratio``; the peers bound theirs the same way).

It reports each run's final validation loss (same data, same seed), their gap (target: within 2%), which peers
the liars' trainer banned, and the signed ban reports ``swarm status`` shows after the run.

    .venv/bin/python bench/liars.py [--steps 30]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402

from swarm.coordinator.localswarm import LocalSwarm, finished, wait_ready  # noqa: E402

TARGET = 0.02  # |val(liars) - val(honest)| / val(honest)
OUTPUT_LIE, GRADIENT_LIE = 1.5, 1e6
_BANNED = re.compile(r"banned for the run: (.*)$", re.M)


@dataclass(frozen=True, kw_only=True)
class LiarsConfig:
    steps: int = 30  # global batches
    target_batch_size: int = 32
    microbatch_size: int = 8
    spot_check_share: float = 0.25
    max_gradient_ratio: float = 1000.0
    seed: int = 0

    def peer_flags(self) -> list[str]:
        return [
            "--preset",
            "tiny",
            "--codec",
            "none",
            "--target-batch-size",
            str(self.target_batch_size),
            "--matchmaking-s",
            "0.5",
            "--no-rebalance",
            "--max-gradient-ratio",
            str(self.max_gradient_ratio),
        ]


@dataclass
class Outcome:
    label: str
    val_loss: float
    final_loss: float
    tokens_per_s: float
    seconds: float
    liars: dict[str, str]  # role -> peer id
    banned: set[str]
    reported: list[dict]  # `swarm status --json`'s "reported"


def run(cfg: LiarsConfig, workdir: Path, *, liars: bool) -> Outcome:
    label = "liars" if liars else "honest"
    run_id = f"liars-{label}"
    roles = {
        "s0-a": (0, []),
        "s0-b": (0, []),
        "s0-c": (0, ["--lie-output-scale", str(OUTPUT_LIE)] if liars else []),
        "s1-a": (1, []),
        "s1-b": (1, ["--lie-gradient-scale", str(GRADIENT_LIE)] if liars else []),
    }
    with LocalSwarm(workdir / label) as swarm:
        procs = {
            name: swarm.peer(name, stage, *cfg.peer_flags(), *extra, run_id=run_id, wait=False)
            for name, (stage, extra) in roles.items()
        }
        endpoints = {name: wait_ready(proc) for name, proc in procs.items()}
        trainer = swarm.trainer(
            "trainer",
            run_id=run_id,
            steps=cfg.steps,
            microbatch_size=cfg.microbatch_size,
            in_flight=4,
            eval_batches=8,
            eval_every_steps=0,
            seed=cfg.seed,
            log_every_s=10,
            spot_check_share=cfg.spot_check_share,
            max_gradient_ratio=cfg.max_gradient_ratio,
        )
        summary = finished(trainer, timeout_s=1800)
        # (a loaded machine takes its time to start the status command's DHT node)
        status = swarm.status(run_id, timeout_s=600) if liars else {"stages": []}
    by_endpoint = {
        r["endpoint"]: r["peer_id"] for stage in status["stages"] for r in stage["replicas"]
    }
    ids = {name: by_endpoint.get(endpoint, "?") for name, endpoint in endpoints.items()}
    found = _BANNED.findall("".join(trainer.lines))
    banned = (
        set() if not found or found[-1].strip() == "none" else set(found[-1].strip().split(", "))
    )
    return Outcome(
        label=label,
        val_loss=summary.val_loss,
        final_loss=summary.final_loss,
        tokens_per_s=summary.tokens_per_s,
        seconds=summary.seconds,
        liars={"wrong outputs (s0-c)": ids["s0-c"], "huge gradients (s1-b)": ids["s1-b"]}
        if liars
        else {},
        banned=banned,
        reported=status.get("reported", []),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=LiarsConfig.steps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--honest-val-loss",
        type=float,
        default=None,
        help="skip the honest run and compare with this final validation loss of an earlier one (same commit, "
        "steps and seed; the result says so)",
    )
    args = parser.parse_args()
    cfg = LiarsConfig(steps=args.steps, seed=args.seed)
    command = f".venv/bin/python bench/liars.py --steps {cfg.steps} --seed {cfg.seed}"
    info = RunInfo(command=command)
    workdir = Path(tempfile.mkdtemp(prefix="swarm-bench-liars-"))
    if args.honest_val_loss is None:
        honest = run(cfg, workdir, liars=False)
    else:
        info.extra.append(
            f"the honest run's validation loss ({args.honest_val_loss}) comes from an earlier run of the same "
            f"command at the same commit (this one ran with --honest-val-loss); its other columns are not known"
        )
        honest = Outcome(
            "honest (earlier run)",
            args.honest_val_loss,
            math.nan,
            math.nan,
            math.nan,
            {},
            set(),
            [],
        )
    lying = run(cfg, workdir, liars=True)
    info.finish()
    gap = abs(lying.val_loss - honest.val_loss) / honest.val_loss
    liar_ids = set(lying.liars.values())
    rows = [
        [
            o.label,
            f"{o.val_loss:.4f}",
            f"{o.final_loss:.4f}",
            f"{o.tokens_per_s:,.0f}",
            f"{o.seconds:.0f}",
            ", ".join(sorted(o.banned)) or "none",
        ]
        for o in (honest, lying)
    ]
    table = markdown_table(
        ["run", "final validation loss", "final training loss", "tokens/s", "seconds", "banned"],
        rows,
    )
    reports = (
        "\n".join(
            f"- `{r['peer_id']}` (stage {r['stage']}): {r['kind']}, reported by {len(r['reporters'])} "
            f"trainer(s), {'avoided' if r['avoided'] else 'suspect'}: {r['reason']}"
            for r in lying.reported
        )
        or "- none"
    )
    verdict = "yes" if gap <= TARGET else "**no**"
    body = (
        f"tiny preset, 2 stages (3 + 2 replicas, averaging, codec none) on loopback; {cfg.steps} global batches of "
        f"{cfg.target_batch_size} samples (microbatch {cfg.microbatch_size}, 4 in flight); trainer seed {cfg.seed}; "
        f"spot-check share {cfg.spot_check_share}, max gradient ratio {cfg.max_gradient_ratio:g}; validation on 8 "
        f"fixed batches.\n\n{table}\n\n"
        f"- gap in final validation loss: {100 * gap:.2f}% (target {100 * TARGET:.0f}%): {verdict}\n"
        f"- liars: {', '.join(f'{k} = `{v}`' for k, v in lying.liars.items())}; banned by the trainer: "
        f"{'both' if liar_ids <= lying.banned else 'NOT all'}"
        f"{'; an honest peer was banned too' if lying.banned - liar_ids else ''}\n"
        f"- ban reports in the DHT after the liars' run (`swarm status`), one trainer so each is a suspect to "
        f"other trainers until a second one confirms it:\n{reports}\n"
    )
    path = write_result(
        RESULTS_DIR / "liars.md",
        title="Liars: a swarm with a lying peer and a huge-gradient peer against an honest one",
        info=info,
        body=body,
    )
    print(body)
    print(f"wrote {path}")
    return 0 if gap <= TARGET and liar_ids <= lying.banned else 1


if __name__ == "__main__":
    sys.exit(main())
