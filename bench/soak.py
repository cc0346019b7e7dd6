"""Soak: a swarm of averaging replicas (the default mode) trained through a fault every ~20 s, and what it kept.

One local swarm (`tiny`, 2 stages x 3 peers, target batch 32 = 4 microbatches of 8, the trainer in its default
lockstep) first trains a calm stretch, then a long one while the script hits a random replica every
``--fault-every-s`` (jittered): SIGKILL then a fresh replacement ("kill"), SIGSTOP for ``--freeze-s`` then
SIGCONT ("freeze"), SIGTERM (a drain) then a fresh replacement ("drain"). A stage always keeps one live replica.

What it reports, from the trainer's summary and each peer's per-step log line (peers run with
``SWARM_LOG_LEVEL=DEBUG``; ``swarm.averaging.optimizer`` logs every step with the samples the replica put in):

- microbatches the trainer started, completed, retried, and commits it could not confirm;
- per stage, the samples its steps averaged against the samples trained: more is a microbatch applied twice,
  fewer is one lost (a replica that stepped alone while its peers averaged, or reloaded, loses its part); a
  replica whose peers' group ran without it hands its samples over into the next step, counted for their own batch
  (and apart, as "one step late");
- the share of the stage's steps that averaged the whole global batch (``target`` samples) in that step;
- whether the replicas of each stage hold the same parameters at the end (``swarm status --json``);
- tokens/s of the soak against the calm stretch, and the time-weighted share of replicas alive; and apart from
  the stalls (no step for over ``STALL_STEPS`` calm steps' time, each with the fault it followed): a fault's cost in
  capacity (replicas missing) against its cost in time (timeouts: a frozen replica's calls and close waited out);
- a loss-curve PNG (calm and soak) under ``docs/``.

    .venv/bin/python bench/soak.py [--duration-s 600] [--fault-every-s 20] [--peers-per-stage 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    REPO_ROOT,
    RESULTS_DIR,
    LossCurves,
    RunInfo,
    markdown_table,
    plot_loss_curves,
    write_result,
)

from swarm.averaging.optimizer import HAND_OVER_STEPS  # noqa: E402
from swarm.coordinator.agreement import settled_verdict  # noqa: E402
from swarm.coordinator.localswarm import LocalSwarm, finished, read_metrics  # noqa: E402
from swarm.model import MODEL_PRESETS  # noqa: E402

TARGET, MICROBATCH = 32, 8
PEER_FLAGS = [
    *("--preset", "tiny", "--target-batch-size", str(TARGET), "--no-rebalance"),
    *("--heartbeat-s", "0.5", "--ttl-s", "3", "--averaging-timeout-s", "15"),
]
STEP_LINE = re.compile(
    r"stage (\d+) step (\d+): (averaged|stepped alone|skipped its step|stepped without its peers' gradients|"
    r"received part of the all-reduce only|stepped alone beside a replica holding samples), (\d+) samples in"
    r"(?: \(handed over: ([^)]*)\))?"
)
CONTRIBUTED = ("averaged", "stepped alone")  # a replica's samples reached its stage's step
BEHIND_LINE = re.compile(
    r"stage (\d+) replica is behind its peers \(step (\d+) < \d+\): loading their state \((\d+) samples"
)
HANDED_LINE = re.compile(r"stage (\d+): (\d+) samples of step (\d+) handed over into step \d+")
KEPT_LINE = re.compile(
    r"stage (\d+) kept the state it stepped into at step (\d+): its (\d+) samples stay in"
)
PARTIAL_LINE = re.compile(
    r"stage (\d+): its all-reduce of step (\d+) returned part of the average only before its peers stepped: "
    r"their step very likely holds its (\d+) samples"
)
# cause -> its log line and the group of it that holds the samples
COUNTED_LINES = (
    ("behind", BEHIND_LINE, 3),
    ("handed", HANDED_LINE, 2),
    ("kept", KEPT_LINE, 3),
    ("partial", PARTIAL_LINE, 3),
)
# why a replica's samples missed its stage's step, by its log line
CAUSES = {
    "behind": "missed its group (its peers' group assembled without it; it loaded their state)",
    "handed": "handed over into the next step (a replica that missed its group, or stepped on its own and loaded "
    f"another state: applied late, up to {HAND_OVER_STEPS} steps, not lost)",
    "partial": "of those, not handed over: its all-reduce with them returned part of the average only, so their "
    "step very likely holds them (counted lost below, never applied twice)",
    "stepped without its peers' gradients": "found no group within --averaging-timeout-s (stepped on its own, "
    "then reloaded)",
    "received part of the all-reduce only": "a groupmate's part missing (frozen or killed mid all-reduce; reloaded)",
    "skipped its step": "non-finite average: a group holding none of the batch's samples (reloaded)",
    "stepped alone beside a replica holding samples": "told it was alone while the records showed another "
    "replica's samples of the batch (reloaded)",
    "kept": "of the reloaded above, kept the state they stepped into (no donor, or one that had loaded it): their "
    "samples stay in that state (counted lost below; in the stage's model if its peers took that state)",
}


class Soak:
    """The swarm, its live replicas per stage, and the faults injected so far."""

    def __init__(
        self, swarm: LocalSwarm, run_id: str, peers_per_stage: int, seed: int, freeze_s: float
    ):
        self.swarm, self.run_id, self.freeze_s = swarm, run_id, freeze_s
        self.rng = random.Random(seed)
        self.live: dict[int, list[str]] = {0: [], 1: []}
        self.started = 0
        self.faults: list[tuple[float, str, str]] = []  # (wall time, kind, peer name)
        self.alive_samples: list[float] = []  # share of replicas alive, sampled every second
        self.peers_per_stage = peers_per_stage
        self.stop = threading.Event()

    def add_peer(self, stage: int, *, wait: bool = True) -> str:
        name = f"s{stage}-{self.started}"
        self.started += 1
        proc = self.swarm.peer(name, stage, *PEER_FLAGS, run_id=self.run_id, wait=False)
        if wait:
            self.swarm.wait_ready(proc)
        self.live[stage].append(name)
        return name

    def proc(self, name: str):
        return self.swarm.group.procs[name]

    def one_fault(self) -> None:
        kind = self.rng.choice(["kill", "freeze", "drain"])
        stages = [k for k, names in self.live.items() if len(names) >= 2]
        if not stages:
            return
        stage = self.rng.choice(stages)
        name = self.rng.choice(self.live[stage])
        self.faults.append((time.time(), kind, name))
        print(f"  fault: {kind} {name}", flush=True)
        if kind == "freeze":
            self.proc(name).signal(signal.SIGSTOP)
            self.live[stage].remove(name)
            self.stop.wait(self.freeze_s)
            self.proc(name).signal(signal.SIGCONT)
            self.live[stage].append(name)
            return
        self.live[stage].remove(name)
        if kind == "kill":
            self.proc(name).signal(signal.SIGKILL)
        else:
            self.proc(name).signal(signal.SIGTERM)
            self.proc(name).popen.wait(timeout=120)
        self.stop.wait(5.0)
        self.add_peer(stage)  # the replacement downloads the stage's state before it serves

    def inject(self, every_s: float) -> None:
        while not self.stop.wait(every_s * self.rng.uniform(0.75, 1.25)):
            self.one_fault()

    def sample_alive(self) -> None:
        while not self.stop.wait(1.0):
            alive = sum(len(v) for v in self.live.values())
            self.alive_samples.append(alive / (2 * self.peers_per_stage))


# A gap between two steps of the soak longer than this many calm steps' time is a stall (a timeout waited out);
# faults that cost capacity only slow the steps down
STALL_STEPS = 4


def stalls(
    steps: list[dict], calm_step_s: float, faults: list[tuple[float, str, str]]
) -> list[tuple[float, float, str]]:
    """The soak's stalls: (start wall time, seconds beyond a calm step, the kind of the last fault before it, or
    "none" if none came in the 30 s before)."""
    out = []
    for before, after in zip(steps, steps[1:]):
        gap = after["wall_time"] - before["wall_time"]
        if gap <= STALL_STEPS * calm_step_s:
            continue
        start = before["wall_time"]
        kinds = [kind for at, kind, _ in faults if start - 30.0 <= at <= after["wall_time"]]
        out.append((start, gap - calm_step_s, kinds[-1] if kinds else "none"))
    return out


def stall_lines(
    steps: list[dict], calm_step_s: float, faults, tokens_per_step: int, calm_tokens_per_s: float
) -> list[str]:
    found = stalls(steps, calm_step_s, faults)
    total_s = steps[-1]["wall_time"] - steps[0]["wall_time"]
    stalled_s = sum(s for _, s, _ in found)
    by_kind: dict[str, list[float]] = defaultdict(list)
    for _, seconds, kind in found:
        by_kind[kind].append(seconds)
    outside = tokens_per_step * (len(steps) - 1) / max(total_s - stalled_s, 1e-9)
    return [
        f"- stalls (no step for over {STALL_STEPS} calm steps' time, {STALL_STEPS * calm_step_s:.1f} s): "
        f"{len(found)}, {stalled_s:.0f} s of the soak's {total_s:.0f} s ("
        + (
            ", ".join(
                f"after a {kind}: {len(v)}, {sum(v):.0f} s, longest {max(v):.1f} s"
                for kind, v in sorted(by_kind.items())
            )
            or "none"
        )
        + ")",
        f"- soak tokens/s outside the stalls / calm tokens/s: {outside / calm_tokens_per_s:.2f}",
    ]


HANDED_PART = re.compile(r"(\d+) of step (\d+)")


def step_contributions(
    workdir: Path,
) -> dict[int, dict[int, list[tuple[str, int, dict[int, int]]]]]:
    """stage -> step -> [(outcome, samples of that step's batch in it, {earlier batch: its samples in it})] over
    every peer's log (a replica whose peers' group ran without it, or whose microbatch came after its step's
    all-reduce began, hands those samples over into the next step)."""
    out: dict[int, dict[int, list[tuple[str, int, dict[int, int]]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for log in workdir.glob("s*-*.log"):
        for match in STEP_LINE.finditer(log.read_text(errors="replace")):
            stage, step, outcome, samples, handed = match.groups()
            earlier = {int(k): int(n) for n, k in HANDED_PART.findall(handed or "")}
            out[int(stage)][int(step)].append(
                (outcome, int(samples) - sum(earlier.values()), earlier)
            )
    return out


def miss_rows(workdir: Path) -> list[list[object]]:
    """Why replicas' samples missed their stage's step: per cause, the replica-steps and the samples left out."""
    found: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for log in workdir.glob("s*-*.log"):
        text = log.read_text(errors="replace")
        for match in STEP_LINE.finditer(text):
            _, _, outcome, samples, _ = match.groups()
            if outcome not in CONTRIBUTED:
                found[outcome][0] += 1
                found[outcome][1] += int(samples)
        for cause, line, group in COUNTED_LINES:
            for match in line.finditer(text):
                found[cause][0] += 1
                found[cause][1] += int(match.group(group))
    order = list(CAUSES)  # the causes, then what became of their samples
    return [
        [CAUSES[k], n, samples]
        for k, (n, samples) in sorted(found.items(), key=lambda kv: order.index(kv[0]))
    ]


def stage_rows(contributions, steps: int) -> list[list[object]]:
    rows = []
    for stage in (0, 1):
        per_step = contributions.get(stage, {})
        # samples of batch s averaged in step s, and in later steps (handed over)
        in_step = {
            s: sum(n for outcome, n, _ in per_step.get(s, []) if outcome in CONTRIBUTED)
            for s in range(steps)
        }
        late = dict.fromkeys(range(steps), 0)
        for entries in per_step.values():
            for outcome, _, earlier in entries:
                if outcome in CONTRIBUTED:
                    for batch, n in earlier.items():
                        late[batch] = late.get(batch, 0) + n
        averaged = {s: in_step[s] + late[s] for s in range(steps)}
        whole = sum(1 for s in range(steps) if in_step[s] == TARGET)
        twice = sum(max(0, n - TARGET) for n in averaged.values())
        lost = sum(max(0, TARGET - n) for n in averaged.values())
        reloads = sum(
            1
            for s in range(steps)
            for outcome, _, _ in per_step.get(s, [])
            if outcome not in CONTRIBUTED
        )
        rows.append(
            [
                stage,
                steps * TARGET,
                sum(averaged.values()),
                sum(late.values()),
                twice,
                lost,
                f"{whole}/{steps} = {whole / max(steps, 1):.3f}",
                reloads,
            ]
        )
    return rows


def train(swarm: LocalSwarm, run_id: str, name: str, steps: int, workdir: Path):
    metrics = workdir / f"{name}.metrics.jsonl"
    trainer = swarm.trainer(
        name,
        run_id=run_id,
        steps=steps,
        microbatch_size=MICROBATCH,
        in_flight=4,
        eval_every_steps=0,
        eval_batches=4,
        metrics_path=str(metrics),
    )
    return trainer, metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--duration-s", type=float, default=600.0, help="length of the faulty stretch"
    )
    parser.add_argument("--fault-every-s", type=float, default=20.0)
    parser.add_argument("--freeze-s", type=float, default=10.0)
    parser.add_argument("--peers-per-stage", type=int, default=3)
    parser.add_argument("--calm-steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ["SWARM_LOG_LEVEL"] = "DEBUG"  # the peers' per-step lines
    info = RunInfo(command="python bench/soak.py " + " ".join(sys.argv[1:]))
    workdir = Path(tempfile.mkdtemp(prefix="swarm-soak-"))
    run_id = "soak"
    print(f"soak: logs in {workdir}", flush=True)
    with LocalSwarm(workdir) as swarm:
        soak = Soak(swarm, run_id, args.peers_per_stage, args.seed, args.freeze_s)
        for stage in (0, 1):
            for _ in range(args.peers_per_stage):
                soak.add_peer(stage, wait=False)
        for names in soak.live.values():
            for name in names:
                swarm.wait_ready(soak.proc(name))
        calm_trainer, calm_metrics = train(swarm, run_id, "calm", args.calm_steps, workdir)
        calm = finished(calm_trainer, timeout_s=3600)
        print(f"calm: {calm.describe()}", flush=True)
        # as many steps as the calm rate fills the faulty stretch with
        calm_steps_per_s = args.calm_steps / max(
            read_metrics(calm_metrics).steps[-1]["time_s"], 1e-9
        )
        soak_steps = max(10, int(calm_steps_per_s * args.duration_s))
        trainer, soak_metrics = train(swarm, run_id, "soak", soak_steps, workdir)
        threads = [
            threading.Thread(target=soak.inject, args=(args.fault_every_s,), daemon=True),
            threading.Thread(target=soak.sample_alive, daemon=True),
        ]
        for thread in threads:
            thread.start()
        try:
            result = finished(trainer, timeout_s=max(3600, 6 * args.duration_s))
        finally:
            soak.stop.set()
            for thread in threads:
                thread.join(timeout=args.freeze_s + 180)
        print(f"soak: {result.describe()}", flush=True)
        (workdir / "faults.json").write_text(json.dumps(soak.faults))
        verdict, agreement_line = None, ""
        deadline = time.monotonic() + 400  # a status process takes minutes at load 30+
        while verdict is None and time.monotonic() < deadline:
            try:
                verdict, agreement_line = settled_verdict(swarm.status(run_id, timeout_s=300))
            except RuntimeError as e:
                agreement_line = str(e)
            if verdict is None:
                time.sleep(1.0)  # replicas re-announce every heartbeat
    info.finish()
    total_steps = args.calm_steps + soak_steps
    rows = stage_rows(step_contributions(workdir), total_steps)
    alive = sum(soak.alive_samples) / max(len(soak.alive_samples), 1)
    kinds = defaultdict(int)
    for _, kind, _ in soak.faults:
        kinds[kind] += 1
    plot_path = REPO_ROOT / "docs" / "soak.png"
    curves = []
    for label, path, offset in (
        ("calm", calm_metrics, 0),
        ("soak (faults)", soak_metrics, args.calm_steps),
    ):
        steps = read_metrics(path).steps
        curves.append(
            LossCurves(
                label=label,
                train=[((offset + s["step"]) * TARGET, s["loss"]) for s in steps],
                val=[
                    (
                        (offset + steps[-1]["step"]) * TARGET,
                        result.val_loss if offset else calm.val_loss,
                    )
                ],
            )
        )
    try:
        plot_loss_curves(curves, title="soak: 2 stages x 3 averaging replicas", path=plot_path)
    except ImportError:
        plot_path = None
    body = "\n".join(
        [
            f"- {args.peers_per_stage} averaging replicas per stage, `tiny`, target batch {TARGET}, microbatch "
            f"{MICROBATCH}, 4 in flight, the trainer's default (lockstep); a calm stretch of {args.calm_steps} "
            f"steps, then {soak_steps} steps with a fault every ~{args.fault_every_s:g} s "
            f"({', '.join(f'{k} x{n}' for k, n in sorted(kinds.items()))}; freeze {args.freeze_s:g} s)",
            f"- logs: {workdir}"
            + (f"; plot: {plot_path.relative_to(REPO_ROOT)}" if plot_path else ""),
            "",
            markdown_table(
                [
                    "run",
                    "steps",
                    "microbatches started/completed",
                    "retried calls",
                    "unconfirmed",
                    "tokens/s",
                    "val loss",
                ],
                [
                    [
                        "calm",
                        args.calm_steps,
                        f"{calm.microbatches_started}/{calm.microbatches}",
                        calm.failed_calls,
                        calm.unconfirmed_commits,
                        f"{calm.tokens_per_s:,.0f}",
                        f"{calm.val_loss:.3f}",
                    ],
                    [
                        "soak",
                        soak_steps,
                        f"{result.microbatches_started}/{result.microbatches}",
                        result.failed_calls,
                        result.unconfirmed_commits,
                        f"{result.tokens_per_s:,.0f}",
                        f"{result.val_loss:.3f}",
                    ],
                ],
            ),
            "",
            markdown_table(
                [
                    "stage",
                    "samples trained",
                    "samples its steps averaged",
                    "of them in a later step",
                    "applied twice",
                    "lost",
                    "steps with the whole batch",
                    "replica steps reloaded",
                ],
                rows,
            ),
            "",
            "Why samples missed a step (every replica's log, calm and soak; a killed replica's part is computed "
            "again by the trainer and is not listed):",
            "",
            markdown_table(
                ["cause", "replica steps", "samples left out"],
                miss_rows(workdir) or [["none", 0, 0]],
            ),
            "",
            f"- soak tokens/s / calm tokens/s: {result.tokens_per_s / calm.tokens_per_s:.2f}; time-weighted share "
            f"of replicas alive during the soak: {alive:.2f}",
            *stall_lines(
                read_metrics(soak_metrics).steps,
                read_metrics(calm_metrics).steps[-1]["time_s"] / args.calm_steps,
                soak.faults,
                TARGET * MODEL_PRESETS["tiny"].seq_len,
                calm.tokens_per_s,
            ),
            f"- replicas at the end: {'agree' if verdict else 'DISAGREE' if verdict is False else 'unchecked'} "
            f"({agreement_line})",
        ]
    )
    path = write_result(
        RESULTS_DIR / "soak.md",
        title="Soak: averaging replicas through faults",
        info=info,
        body=body,
    )
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
