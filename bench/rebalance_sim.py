"""Throughput over time of a 1000-peer simulated swarm under churn, with and without rebalancing.

Run from the repository root:  .venv/bin/python bench/rebalance_sim.py
Prints markdown tables and writes them, with the environment, to bench/results/rebalance_sim.md.

The swarm: 1000 peers over 4 stages (speeds uniform in 2..8 samples/s), 32 trainers keeping 48
microbatches of 32 samples in flight each, new peers arriving at 0.2/s, a mean peer lifetime of
3000 s, and at t=120 s 60% of stage 1's peers preempted at once. Every run uses the trainer's
routing policy (swarm.routing, default config) and the same seed; only the named knobs differ.
Simulator cost is measured as CPU seconds of one process (the simulator is single-threaded).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as a script from a checkout without installing

from swarm.balance import RebalanceConfig  # noqa: E402
from swarm.sim import Preemption, SimConfig, SimResult, simulate  # noqa: E402

COMMAND = ".venv/bin/python bench/rebalance_sim.py"


def base_config(num_peers: int, duration_s: float) -> SimConfig:
    return SimConfig(
        num_stages=4,
        num_peers=num_peers,
        num_trainers=32,
        microbatches_in_flight=48 * num_peers // 1000 or 1,
        microbatch_size=32,
        duration_s=duration_s,
        arrival_rate_per_s=0.2 * num_peers / 1000,
        mean_lifetime_s=3000.0,
        preemptions=(Preemption(time_s=120.0, stage=1, fraction=0.6),),
        balance=RebalanceConfig(period_s=30.0),
        sample_period_s=10.0,
        seed=0,
    )


def run(name: str, config: SimConfig) -> tuple[SimResult, float]:
    started = time.process_time()
    result = simulate(config)
    cpu_s = time.process_time() - started
    print(
        f"  {name}: {cpu_s:.1f} s CPU, {result.events} events, {result.num_moves} moves", flush=True
    )
    return result, cpu_s


def table(results: dict[str, SimResult], every_s: float) -> str:
    """Per ``every_s`` interval: mean samples/s, the bottleneck stage's capacity and peers per stage."""
    names = list(results)
    header = ["t (s)"]
    for name in names:
        header += [f"{name} samples/s", f"{name} bottleneck capacity", f"{name} peers/stage"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    end = results[names[0]].times_s[-1]
    t = every_s
    while t <= end + 1e-9:
        row = [f"{t:.0f}"]
        for name in names:
            result = results[name]
            index = max(i for i, ts in enumerate(result.times_s) if ts <= t + 1e-9)
            row += [
                f"{result.mean_throughput(t - every_s, t):.0f}",
                f"{min(result.capacity_per_stage[index]):.0f}",
                "/".join(str(n) for n in result.peers_per_stage[index]),
            ]
        lines.append("| " + " | ".join(row) + " |")
        t += every_s
    return "\n".join(lines)


def summary(results: dict[str, SimResult], cpu: dict[str, float], after_s: float) -> str:
    lines = [
        "| run | mean samples/s after t=120 s | moves | failed requests | recomputes | arrived | died "
        "| events | CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        lines.append(
            f"| {name} | {result.mean_throughput(after_s):.0f} | {result.num_moves} | {result.hop_failures} "
            f"| {result.recomputes} | {result.peers_arrived} | {result.peers_died} | {result.events} "
            f"| {cpu[name]:.1f} |"
        )
    return "\n".join(lines)


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--peers", type=int, default=1000, help="peers at t=0 (load and churn scale with it)"
    )
    parser.add_argument("--duration-s", type=float, default=600.0, help="simulated seconds")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "bench" / "results" / "rebalance_sim.md"
    )
    args = parser.parse_args(argv)

    base = base_config(args.peers, args.duration_s)
    variants = {
        "rebalancing": dataclasses.replace(base, rebalance=True, skip_expired=True),
        "static": dataclasses.replace(base, rebalance=False, skip_expired=True),
        "rebalancing, peers compute expired requests": dataclasses.replace(
            base, rebalance=True, skip_expired=False
        ),
        "static, peers compute expired requests": dataclasses.replace(
            base, rebalance=False, skip_expired=False
        ),
    }
    results: dict[str, SimResult] = {}
    cpu: dict[str, float] = {}
    print(f"simulating {args.peers} peers for {args.duration_s:.0f} s, {len(variants)} runs:")
    for name, config in variants.items():
        results[name], cpu[name] = run(name, config)

    main_runs = {k: results[k] for k in ("rebalancing", "static")}
    today_runs = {
        "rebalancing": results["rebalancing, peers compute expired requests"],
        "static": results["static, peers compute expired requests"],
    }
    report = "\n".join(
        [
            "# Rebalancing in a simulated 1000-peer swarm",
            "",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- commit: {git_commit()}",
            f"- machine: {platform.machine()}, os.cpu_count() = {os.cpu_count()}, Python {platform.python_version()}",
            f"- reproduce: `{COMMAND}` (add `--peers 200` for a quick look)",
            "",
            "Scenario: " + " ".join(line.strip() for line in __doc__.split("\n\n")[2].splitlines()),
            f"Rebalancing: `RebalanceConfig(period_s=30)` (min_gain {base.balance.min_gain}, cooldown "
            f"{base.balance.cooldown_periods} periods); a move drains {base.drain_s:.0f} s and loads "
            f"{base.load_s:.0f} s. Bottleneck capacity = the smallest stage's summed peer speed (samples/s).",
            "",
            "## Peers skip requests whose deadline passed (skip_expired=True)",
            "",
            table(main_runs, 60.0),
            "",
            "## Peers compute expired requests anyway (the daemon's --no-shed-late-work)",
            "",
            table(today_runs, 60.0),
            "",
            "## Totals",
            "",
            summary(results, cpu, 120.0),
            "",
            f"Simulator cost: {args.peers} peers x {args.duration_s:.0f} simulated s took "
            f"{min(cpu.values()):.1f}-{max(cpu.values()):.1f} s of CPU per run on one core.",
            "",
        ]
    )
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
