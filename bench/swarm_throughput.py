"""Swarm training throughput on loopback against the same model trained in one process on this machine.

Run from the repository root:  .venv/bin/python bench/swarm_throughput.py [--seconds N] [--configs tiny,w1]
Prints a markdown table and writes it, with the environment, to bench/results/swarm_throughput.md.

Swarm side: a bootstrap DHT node, ``peers_per_stage`` peers per stage (``swarm peer --threads 1``) and one
trainer (``swarm train``, OMP_NUM_THREADS=1), all separate processes started with ``ProcessGroup`` (so every
one of them is stopped, whatever happens). The trainer runs until interrupted; its ``--metrics-path`` JSON
lines give cumulative tokens at each step, and tokens/s is taken over the window after ``--warmup-seconds``
of training (startup, DHT discovery and first-call allocation excluded). Peers of a preset are reused: the
x2 configuration adds one peer per stage to the x1 swarm and starts a fresh trainer.

Single-process side: ``swarm.trainer.reference.train_reference``, the swarm's twin in this process: the same
model, microbatch size, global batch, per-stage optimizers, learning-rate schedule and clipping as the swarm's
run config, at 1 torch thread and at all cores, timed over global batches after a short warmup.

CPU use of each role (peers, trainer, bootstrap; each process group, so hivemind's DHT child processes and
p2pd count too) is read from /proc over the measured window, to show where the cycles go.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import RESULTS_DIR, RunInfo, load_average, markdown_table, write_result  # noqa: E402

from swarm.config import RunConfig  # noqa: E402
from swarm.coordinator.launcher import ProcessGroup  # noqa: E402
from swarm.coordinator.localswarm import LocalSwarm, wait_ready  # noqa: E402
from swarm.data import ByteCorpus, DataConfig  # noqa: E402
from swarm.model import MODEL_PRESETS  # noqa: E402
from swarm.peer.heap import bound_heap  # noqa: E402
from swarm.trainer.reference import train_reference  # noqa: E402

MICROBATCH = 8  # sequences per microbatch (BENCHMARKS.md)
IN_FLIGHT = 4  # microbatches in the pipeline at once (the demo's default)
TARGET_BATCH = 32  # samples per optimizer step of each stage (the demo's default)
LR = 3e-4  # BENCHMARKS.md
TRAINER_PROGRESS = r"^\r?step \d+"
CONFIGS = {"tiny": [2], "w1": [1, 2]}  # preset -> peers per stage to measure, in increasing order
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class SwarmResult:
    preset: str
    peers_per_stage: int
    num_stages: int
    tokens_per_s: float
    window_s: float
    steps: int  # global batches completed in the window
    load: float  # 1-minute load average at the end of the window
    # role -> cores used (CPU-s per s) in the window
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_cpu_s(self) -> float:
        """Tokens per CPU-second of all the swarm's processes: robust to other users' load, unlike tokens/s."""
        return self.tokens_per_s / sum(self.cpu_s.values())


@dataclass
class LocalResult:
    preset: str
    threads: int
    tokens_per_s: float
    tokens_per_cpu_s: float  # tokens per CPU-second of this process (all threads)
    steps: int  # timed global batches (after warmup)
    load: float  # 1-minute load average at the end


@dataclass
class Baseline:
    """One process at one thread count, measured before and after the preset's swarm runs: load from other
    users drifts, and the mean of the two brackets the swarm's measurements in time."""

    before: LocalResult
    after: LocalResult

    @property
    def tokens_per_s(self) -> float:
        return (self.before.tokens_per_s + self.after.tokens_per_s) / 2

    @property
    def tokens_per_cpu_s(self) -> float:
        return (self.before.tokens_per_cpu_s + self.after.tokens_per_cpu_s) / 2

    def describe(self) -> str:
        return f"{self.before.tokens_per_s:,.0f} / {self.after.tokens_per_s:,.0f}"


# ---------------------------------------------------------------------------------------- CPU accounting


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (Linux /proc).
    Processes of the group that exited already are not counted; none exit during a measured window."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we looked
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
        if int(fields[2]) == pgid:  # field 5 of stat: pgrp
            total += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime (clock ticks)
    return total / CLOCK_TICKS


def role_of(name: str) -> str:
    return "peers" if name.startswith("peer-") else name


def cpu_by_role(group: ProcessGroup) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, proc in group.procs.items():
        if proc.alive():
            out[role_of(name)] = out.get(role_of(name), 0.0) + group_cpu_s(proc.pid)
    return out


# ---------------------------------------------------------------------------------------- swarm side


def start_timed_trainer(
    swarm, name: str, run_id: str, metrics: Path, *, timeout_s: float, **options
):
    """A trainer that runs until stopped (a benchmark measures it over a time window from its metrics file), the
    standard microbatch and depth, no validation; returned once it reports its first step. ``options``: more
    TrainerConfig fields."""
    trainer = swarm.trainer(
        name,
        run_id=run_id,
        steps=0,
        microbatch_size=MICROBATCH,
        in_flight=IN_FLIGHT,
        eval_every_steps=0,
        eval_batches=1,
        metrics_path=metrics,
        **options,
    )
    trainer.wait_for(TRAINER_PROGRESS, timeout_s=timeout_s)
    return trainer


def window_tokens_per_s(metrics_path: Path, warmup_s: float) -> tuple[float, float, int]:
    """(tokens/s, window seconds, steps) between the first step record at or after ``warmup_s`` of training
    and the last one. The trainer writes cumulative tokens/s and elapsed time per step."""
    steps = [
        r for r in map(json.loads, metrics_path.read_text().splitlines()) if "tokens_per_s" in r
    ]
    window = [r for r in steps if r["time_s"] >= warmup_s]
    if len(window) < 2:
        raise RuntimeError(
            f"only {len(window)} steps after {warmup_s:.0f}s of warmup in {metrics_path} "
            f"({len(steps)} in all): train longer (--seconds) or check the trainer's log"
        )
    first, last = window[0], window[-1]
    tokens = last["tokens_per_s"] * last["time_s"] - first["tokens_per_s"] * first["time_s"]
    seconds = last["time_s"] - first["time_s"]
    return tokens / seconds, seconds, last["step"] - first["step"]


def measure_swarm(
    preset: str, peer_counts: list[int], *, seconds: float, warmup_s: float, workdir: Path
) -> list[SwarmResult]:
    """Start a swarm for ``preset`` and measure a fresh trainer at each peers-per-stage count (increasing)."""
    num_stages = MODEL_PRESETS[preset].num_stages
    run_id = f"bench-{preset}"
    results = []
    with LocalSwarm(workdir) as swarm:
        group = swarm.group
        run_flags = ["--preset", preset, "--target-batch-size", TARGET_BATCH, "--lr", LR]
        running = 0
        for count in peer_counts:
            started = [
                swarm.peer(f"peer-s{stage}-{replica}", stage, *run_flags, run_id=run_id, wait=False)
                for replica in range(running, count)
                for stage in range(num_stages)
            ]
            for proc in started:
                wait_ready(proc)
            running = count
            metrics = workdir / f"metrics-x{count}.jsonl"
            name = f"trainer-x{count}"
            print(
                f"  {preset}: {num_stages} stages x {count} peers up; training for {warmup_s + seconds:.0f}s",
                flush=True,
            )
            trainer = start_timed_trainer(swarm, name, run_id, metrics, timeout_s=180)
            # A benchmark's measuring period, not a wait for an event: training runs for a fixed time.
            time.sleep(warmup_s)
            cpu_before, wall_before = cpu_by_role(group), time.monotonic()
            time.sleep(seconds)
            cpu_after, wall = cpu_by_role(group), time.monotonic() - wall_before
            code = group.stop(name, sig=signal.SIGINT, timeout_s=30)
            if code not in (0, 130):
                raise RuntimeError(f"the trainer exited with code {code}; see {trainer.log_path}")
            tps, window_s, steps = window_tokens_per_s(metrics, warmup_s)
            # CPU per role, scaled from the sampled wall interval to a per-second rate over the window.
            cpu = {role: (cpu_after[role] - cpu_before.get(role, 0.0)) / wall for role in cpu_after}
            results.append(
                SwarmResult(preset, count, num_stages, tps, window_s, steps, load_average(), cpu)
            )
            print(
                f"  {preset} x{count}: {tps:,.0f} tokens/s over {window_s:.0f}s ({steps} steps)",
                flush=True,
            )
    return results


# ---------------------------------------------------------------------------------------- one process


def measure_local(
    preset: str,
    corpus: ByteCorpus,
    *,
    threads: int,
    seconds: float,
    warmup_steps: int = 1,
    max_steps: int = 100_000,
) -> LocalResult:
    """train_reference at ``threads`` torch threads for ``warmup_steps`` global batches and then about ``seconds``
    (stopped from its step callback, so a slowdown from other users cannot stretch it); rates over the batches
    after warmup. CPU time is this process's (all its threads), which includes OpenMP spin-waiting at more than
    1 thread."""
    # the swarm's run flags
    run = RunConfig(model=MODEL_PRESETS[preset], target_batch_size=TARGET_BATCH, lr=LR)
    wall: list[float] = []
    cpu: list[float] = []

    def on_step(step: int, loss: float) -> bool:
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
        return step > warmup_steps and wall[-1] - wall[warmup_steps - 1] >= seconds

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = train_reference(
            run,
            corpus,
            steps=max_steps,
            microbatch_size=MICROBATCH,
            eval_batches=0,
            on_step=on_step,
        )
    finally:
        torch.set_num_threads(previous)
    # From the end of the last warmup batch (the first carries one-off allocation costs) to the last batch.
    steps = len(wall) - warmup_steps
    tokens = result.tokens // len(wall) * steps  # every global batch has the same samples
    return LocalResult(
        preset,
        threads,
        tokens / (wall[-1] - wall[warmup_steps - 1]),
        tokens / (cpu[-1] - cpu[warmup_steps - 1]),
        steps,
        load_average(),
    )


# ---------------------------------------------------------------------------------------- report


def best_baseline(local: dict[tuple[str, int], Baseline], preset: str) -> tuple[int, Baseline]:
    """(threads, baseline) of the thread count that trained ``preset`` fastest in one process."""
    return max(
        ((t, b) for (p, t), b in local.items() if p == preset), key=lambda tb: tb[1].tokens_per_s
    )


def report(swarm: list[SwarmResult], local: dict[tuple[str, int], Baseline]) -> str:
    """Two tables: wall-clock tokens/s (what a user sees), and tokens per CPU-second (the swarm's overhead,
    nearly independent of how many cores other users took during the run)."""
    wall_rows, cpu_rows = [], []
    for r in swarm:
        config = f"{r.preset}: {r.num_stages} stages x {r.peers_per_stage} peer(s)"
        threads, best = best_baseline(local, r.preset)
        wall_rows.append(
            [
                config,
                f"{r.tokens_per_s:,.0f}",
                f"{best.tokens_per_s:,.0f} ({threads} thread{'s' if threads > 1 else ''})",
                f"**{r.tokens_per_s / best.tokens_per_s:.2f}**",
                f"{r.load:.1f}",
            ]
        )
        one = local[(r.preset, 1)]
        cores = " / ".join(
            f"{r.cpu_s.get(role, 0.0):.2f}"
            for role in ("peers", f"trainer-x{r.peers_per_stage}", "bootstrap")
        )
        cpu_rows.append(
            [
                config,
                f"{r.tokens_per_cpu_s:,.0f}",
                f"{one.tokens_per_cpu_s:,.0f}",
                f"**{r.tokens_per_cpu_s / one.tokens_per_cpu_s:.2f}**",
                cores,
            ]
        )
    wall = markdown_table(
        [
            "config",
            "swarm tokens/s",
            "1 process tokens/s (fastest thread count)",
            "ratio swarm / 1 process",
            "load (1 min) after",
        ],
        wall_rows,
    )
    cpu = markdown_table(
        [
            "config",
            "swarm tokens per CPU-s",
            "1 process (1 thread) tokens per CPU-s",
            "ratio swarm / 1 process",
            "swarm cores used: peers / trainer / bootstrap",
        ],
        cpu_rows,
    )
    return "\n".join(
        ["Wall clock (tokens/s):", "", wall, "", "CPU efficiency (tokens per CPU-second):", "", cpu]
    )


def baseline_table(local: dict[tuple[str, int], Baseline]) -> str:
    headers = [
        "preset",
        "torch threads",
        "tokens/s before / after the swarm runs",
        "mean tokens/s",
        "mean tokens per CPU-s",
        "load before / after",
    ]
    rows = [
        [
            preset,
            threads,
            b.describe(),
            f"{b.tokens_per_s:,.0f}",
            f"{b.tokens_per_cpu_s:,.0f}",
            f"{b.before.load:.1f} / {b.after.load:.1f}",
        ]
        for (preset, threads), b in local.items()
    ]
    return markdown_table(headers, rows, right_align_from=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="measured training time per swarm config"
    )
    parser.add_argument(
        "--warmup-seconds", type=float, default=6.0, help="training time excluded at the start"
    )
    parser.add_argument(
        "--local-seconds",
        type=float,
        default=6.0,
        help="measured time per single-process baseline (it is steadier than the swarm)",
    )
    parser.add_argument(
        "--configs", default="tiny,w1", help=f"comma-separated presets of {sorted(CONFIGS)}"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="process logs (default: a temporary folder)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "swarm_throughput.md")
    args = parser.parse_args()
    presets = [p for p in args.configs.split(",") if p]
    unknown = sorted(set(presets) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {sorted(CONFIGS)}")
    if args.seconds <= 0 or args.warmup_seconds < 0 or args.local_seconds <= 0:
        raise SystemExit(
            f"need --seconds > 0 ({args.seconds}), --warmup-seconds >= 0 ({args.warmup_seconds}) "
            f"and --local-seconds > 0 ({args.local_seconds})"
        )
    info = RunInfo(
        command=".venv/bin/python bench/swarm_throughput.py"
        + "".join(f" {a}" for a in sys.argv[1:])
    )
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    all_threads = torch.get_num_threads()
    bound_heap()  # the one process allocates as the peers do (swarm.peer.heap)
    corpus = ByteCorpus.load(DataConfig())
    print(f"logs in {workdir}; corpus: {corpus.describe()}", flush=True)

    swarm: list[SwarmResult] = []
    local: dict[tuple[str, int], Baseline] = {}
    thread_counts = sorted({1, all_threads})

    def baselines(preset: str, when: str) -> dict[int, LocalResult]:
        out = {}
        for threads in thread_counts:
            out[threads] = measure_local(
                preset, corpus, threads=threads, seconds=args.local_seconds
            )
            print(
                f"  {preset} in one process ({when}), {threads} thread(s): {out[threads].tokens_per_s:,.0f} "
                f"tokens/s ({out[threads].steps} steps)",
                flush=True,
            )
        return out

    for preset in presets:
        before = baselines(preset, "before")
        swarm += measure_swarm(
            preset,
            CONFIGS[preset],
            seconds=args.seconds,
            warmup_s=args.warmup_seconds,
            workdir=workdir / preset,
        )
        after = baselines(preset, "after")
        for threads in thread_counts:
            local[(preset, threads)] = Baseline(before[threads], after[threads])
    info.finish()

    table = report(swarm, local)
    info.extra += [
        f"swarm: peers `--threads 1`, trainer OMP_NUM_THREADS=1, microbatch {MICROBATCH}, in_flight {IN_FLIGHT}, "
        f"target batch {TARGET_BATCH}, codec none, lr {LR}; measured {args.seconds:g}s after "
        f"{args.warmup_seconds:g}s of warmup",
        f"one process: `train_reference` (the swarm's twin: microbatch {MICROBATCH}, target batch {TARGET_BATCH}, "
        f"per-stage AdamW, lr {LR} with the swarm's schedule), at 1 and {all_threads} torch threads, about "
        f"{args.local_seconds:g}s each after 1 warmup batch",
        "heap: the peers and the one process use swarm.peer.heap's malloc settings"
        + "".join(
            f", {name}={os.environ[name]} from the environment"
            for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
            if name in os.environ
        ),
    ]
    notes = [
        f"All processes share this machine's {os.cpu_count()} cores: a swarm of 2 stages x 2 peers runs 4 peer "
        "processes, a trainer and a bootstrap node (each with a hivemind DHT process and p2pd) on them, so the "
        "ratio mostly shows the overhead of the swarm (serialization, gRPC, thread hops, DHT heartbeats, no "
        "shared memory between stages), not the speed-up that separate machines would give.",
        "Other users' processes share these cores too (load average above): tokens/s of either side depends on "
        "the share of the cores it got at that moment. Tokens per CPU-second hardly does, so the CPU-efficiency "
        "ratio is the one to compare across runs: 0.5 means the swarm spends twice the CPU per token. Under such "
        "load the swarm's many processes also win a larger share of the cores than one process does (compare "
        "its cores used with the baseline's tokens/s over tokens per CPU-s), which flatters its wall-clock ratio.",
        "More peers per stage add concurrency (two replicas of a stage run two microbatches at once) but no "
        "cores here; on separate machines each would bring its own.",
        "Swarm cores used = CPU-seconds per second of wall time over the window, summed over each role's "
        "process groups (peers: all peer processes together, with their DHT processes and p2pd).",
        "One process at 2 torch threads can be far slower than at 1 when other processes hold a core: OpenMP "
        "threads wait for each other. The wall-clock ratio uses the faster thread count of this run.",
        f"The one-process baseline steps AdamW after every microbatch ({MICROBATCH} sequences); the swarm's "
        f"stages step every {TARGET_BATCH} samples, so the baseline does a little more optimizer work per token.",
    ]
    body = "\n".join(
        [
            table,
            "",
            *(f"- {n}" for n in notes),
            "",
            "Single-process baselines (the ratios use the "
            "mean of the runs before and after each preset's swarm runs):",
            "",
            baseline_table(local),
        ]
    )
    path = write_result(
        args.out, title="Swarm throughput vs one process (loopback)", info=info, body=body
    )
    print("\n" + table + f"\n\nwritten to {path}")


if __name__ == "__main__":
    main()
