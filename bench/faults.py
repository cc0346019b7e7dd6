"""Throughput through faults: a peer killed, a peer frozen, a peer rejoining — and how fast routing reacts.

One local swarm (demo config: `tiny`, 2 stages x 2 peers, microbatch 8, 4 in flight) trains without pause
while the script injects, in order: SIGKILL of a stage-0 peer; a fresh peer joining stage 0; SIGSTOP of a
stage-1 peer (frozen: its calls hang until their deadline); SIGCONT. Tokens/s is taken per time bucket from
the trainer's per-step records (wall clock), so the table is a time series with the faults marked.

Detection time of the frozen peer: from SIGSTOP to the trainer's first call to it that fails (its deadline),
after which routing bans it and sends the work elsewhere; recovery: from SIGSTOP until a time bucket is back
at >= 80% of the throughput before the freeze.

A second part measures a slow peer (the figures tests/test_faults.py orders but does not time): stage 0
served by two peers at a quarter speed ("even"), then by one at a quarter and one at a sixteenth ("uneven"),
the same trainer on each; the slow peer's share of stage 0's microbatches against its capacity share (1/5),
and the uneven swarm's tokens/s against the even one's (5/8 if routing matched capacity; 1/4 if work were split
evenly, the slow peer then setting the pace).

    .venv/bin/python bench/faults.py [--phase-s 20] [--bucket-s 2] [--slow-steps 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402

from swarm.coordinator.localswarm import LocalSwarm, finished, wait_ready  # noqa: E402
from swarm.transport.client import PeerClient  # noqa: E402
from swarm.transport.security import address_by_handshake  # noqa: E402

PEER_FLAGS = [
    "--preset",
    "tiny",
    "--target-batch-size",
    "32",
    "--heartbeat-s",
    "0.5",
    "--ttl-s",
    "3",
    "--no-rebalance",
]


def steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line]


def wait_until(trainer, metrics: Path, wall: float) -> None:
    """Block until the trainer has recorded a step at or after ``wall`` (each step prints a line)."""
    while not steps(metrics) or steps(metrics)[-1]["wall_time"] < wall:
        trainer.wait_for(r"^step \d+", timeout_s=120, after_line=len(trainer.lines))


def log_time(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


async def microbatches_applied(endpoint: str, run_id: str) -> int:
    # the bench's own peer process: its certificate taken from the handshake
    client = PeerClient(await asyncio.to_thread(address_by_handshake, endpoint))
    try:
        return (await client.info(run_id, timeout_s=10)).microbatches_applied
    finally:
        await client.close()


def slow_peer_run(label: str, slowdowns: dict[str, float], steps: int) -> tuple[float, dict]:
    """One swarm: stage-0 peers with the given ``--slowdown`` each, one stage-1 peer; a trainer of ``steps``
    steps with 16 microbatches in flight (both stage-0 peers always have work queued). Returns its tokens/s
    and each stage-0 peer's microbatches applied."""
    workdir = Path(tempfile.mkdtemp(prefix=f"swarm-bench-slow-{label}-"))
    with LocalSwarm(workdir) as swarm:
        procs = {
            name: swarm.peer(
                name, 0, *PEER_FLAGS, "--slowdown", f"{factor:g}", run_id=label, wait=False
            )
            for name, factor in slowdowns.items()
        }
        procs["s1-a"] = swarm.peer("s1-a", 1, *PEER_FLAGS, run_id=label, wait=False)
        endpoints = {name: wait_ready(proc) for name, proc in procs.items()}
        trainer = swarm.trainer(
            "trainer", run_id=label, steps=steps, microbatch_size=8, in_flight=16, log_every_s=0
        )
        summary = finished(trainer, timeout_s=1800)
        applied = {
            name: asyncio.run(microbatches_applied(endpoints[name], label)) for name in slowdowns
        }
    return summary.tokens_per_s, applied


def slow_peer_section(steps: int) -> str:
    even_tps, _ = slow_peer_run("even", {"s0-a": 4, "s0-b": 4}, steps)
    uneven_tps, applied = slow_peer_run("uneven", {"s0-fast": 4, "s0-slow": 16}, steps)
    share = applied["s0-slow"] / max(sum(applied.values()), 1)
    table = markdown_table(
        ["measure", "value", "if routing matched capacity"],
        [
            ["tokens/s, even (both stage-0 peers at 1/4 speed)", f"{even_tps:,.0f}", ""],
            ["tokens/s, uneven (one at 1/4, one at 1/16)", f"{uneven_tps:,.0f}", ""],
            ["uneven / even", f"{uneven_tps / even_tps:.2f}", "0.62 (an even split: 0.25)"],
            [
                "slow peer's share of stage 0's microbatches",
                f"{share:.2f} ({applied['s0-slow']} of {sum(applied.values())})",
                "0.20 (an even split: 0.50)",
            ],
        ],
        right_align_from=1,
    )
    print(table)
    return "\n".join(
        [
            "## A slow peer",
            "",
            f"2 stages (`tiny`), stage 0 served by two peers slowed with `--slowdown` (sleeps a multiple of each "
            f"call's CPU time), stage 1 by one; a trainer of {steps} steps (microbatch 8, 16 in flight). "
            "tests/test_faults.py checks only the ordering (the slow peer's share below an even split's "
            "3-sigma bound); the figures are here.",
            "",
            table,
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds between two faults")
    parser.add_argument(
        "--bucket-s", type=float, default=2.0, help="seconds per row of the time series"
    )
    parser.add_argument(
        "--slow-steps",
        type=int,
        default=60,
        help="trainer steps of each slow-peer run (0: skip it)",
    )
    args = parser.parse_args()
    info = RunInfo(
        command="python bench/faults.py"
        + (f" --phase-s {args.phase_s:g}" if args.phase_s != 20 else "")
        + (f" --slow-steps {args.slow_steps}" if args.slow_steps != 60 else "")
    )
    workdir = Path(tempfile.mkdtemp(prefix="swarm-bench-faults-"))
    metrics = workdir / "metrics.jsonl"
    events: list[tuple[float, str]] = []
    with LocalSwarm(workdir) as swarm:
        group = swarm.group
        peers = {
            name: swarm.peer(name, stage, *PEER_FLAGS, run_id="faults", wait=False)
            for name, stage in [("s0-a", 0), ("s0-b", 0), ("s1-a", 1), ("s1-b", 1)]
        }
        for proc in peers.values():
            wait_ready(proc)
        trainer = swarm.trainer(
            "trainer",
            run_id="faults",
            steps=0,
            microbatch_size=8,
            in_flight=4,
            log_every_s=0,
            metrics_path=metrics,
        )
        trainer.wait_for(r"^step 1\b", timeout_s=180)
        start = steps(metrics)[0]["wall_time"]

        def phase(label: str, action) -> float:
            wait_until(trainer, metrics, time.time() + args.phase_s)
            at = time.time()
            action()
            events.append((at, label))
            print(f"{at - start:6.1f}s  {label}", flush=True)
            return at

        phase("SIGKILL peer s0-b (stage 0)", lambda: peers["s0-b"].signal(signal.SIGKILL))
        joined = phase(
            "new peer s0-c joins stage 0",
            lambda: swarm.peer("s0-c", 0, *PEER_FLAGS, run_id="faults", wait=False),
        )
        wait_ready(group.procs["s0-c"])
        events.append(
            (
                log_time(
                    next(line for line in group.procs["s0-c"].lines if "serves stage" in line)
                ),
                "s0-c serving",
            )
        )
        frozen_at = phase(
            "SIGSTOP peer s1-b (stage 1)", lambda: peers["s1-b"].signal(signal.SIGSTOP)
        )
        phase("SIGCONT peer s1-b", lambda: peers["s1-b"].signal(signal.SIGCONT))
        wait_until(trainer, metrics, time.time() + args.phase_s)
        group.stop("trainer", sig=signal.SIGINT)
    slow_section = slow_peer_section(args.slow_steps) if args.slow_steps else ""
    info.finish()

    records = steps(metrics)
    per_step_tokens = 32 * 128  # target_batch_size x seq_len
    end = records[-1]["wall_time"]
    rows, series = [], []
    t = start
    while t < end:
        count = sum(1 for r in records if t <= r["wall_time"] < t + args.bucket_s)
        marks = "; ".join(label for at, label in events if t <= at < t + args.bucket_s)
        series.append((t, count * per_step_tokens / args.bucket_s))
        rows.append(
            [f"{t - start:.0f}–{t - start + args.bucket_s:.0f}", f"{series[-1][1]:,.0f}", marks]
        )
        t += args.bucket_s

    def mean_rate(t0, t1):
        chosen = [r for at, r in series if t0 <= at < t1]
        return sum(chosen) / max(len(chosen), 1)

    before_freeze = mean_rate(frozen_at - args.phase_s + args.bucket_s, frozen_at)
    failures = [
        log_time(line)
        for line in trainer.lines
        if "failed (" in line and line[:4].isdigit() and log_time(line) >= frozen_at
    ]
    detect_s = failures[0] - frozen_at if failures else float("nan")
    recovered = next((at for at, r in series if at >= frozen_at and r >= 0.8 * before_freeze), None)
    recover_s = (recovered + args.bucket_s - frozen_at) if recovered is not None else float("nan")
    summary = markdown_table(
        ["measure", "value"],
        [
            ["tokens/s before the kill", f"{mean_rate(start + args.bucket_s, events[0][0]):,.0f}"],
            [
                "tokens/s between kill and rejoin",
                f"{mean_rate(events[0][0] + args.bucket_s, joined):,.0f}",
            ],
            ["tokens/s after rejoin, before the freeze", f"{before_freeze:,.0f}"],
            ["frozen peer: first failed call after SIGSTOP (detection)", f"{detect_s:.1f} s"],
            ["frozen peer: back to >= 80% of the pre-freeze tokens/s", f"{recover_s:.1f} s"],
            [
                "microbatches lost",
                "0 (the trainer completes every microbatch it starts; see tests/test_faults.py)",
            ],
        ],
        right_align_from=1,
    )
    body = "\n".join(
        [
            "2 stages x 2 peers (`tiny`), one trainer (microbatch 8, 4 in flight), all on this machine's 2 cores; "
            "faults injected with real signals. Detection of a frozen peer is bounded by its call deadline, which "
            "routing sets from the peer's measured latency (`timeout_factor` x predicted round trip + slack, at "
            "least `min_timeout_s`).",
            "",
            summary,
            "",
            f"Time series ({args.bucket_s:g} s buckets):",
            "",
            markdown_table(["seconds", "tokens/s", "event"], rows, right_align_from=1),
            "",
            slow_section,
        ]
    )
    path = write_result(
        RESULTS_DIR / "faults.md", title="Throughput through faults", info=info, body=body
    )
    print(summary)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
