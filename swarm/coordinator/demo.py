"""``swarm demo``: a whole swarm on this machine, as separate processes found through a real DHT.

A bootstrap DHT node, ``peers_per_stage`` peers for each stage and one trainer start on 127.0.0.1;
the trainer trains the demo model and prints its falling loss and a summary; then everything stops.
Logs of every process land in ``workdir``. Ctrl-C stops everything too.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarm.compression import CODEC_NAMES
from swarm.coordinator.localswarm import LocalSwarm
from swarm.model import ALL_PRESETS


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    FLAG_TITLE = "demo"

    preset: str = field(default="tiny", metadata={"choices": tuple(ALL_PRESETS)})  # model preset
    peers_per_stage: int = 2  # peers serving each stage
    # the replicas of a stage average (all-reduce, one step per global batch); --no-average: each steps alone
    average: bool = True
    steps: int = 150  # global batches the trainer runs (a few minutes on 2 cores)
    microbatch_size: int = 8  # sequences per microbatch
    in_flight: int = 4  # microbatches in the pipeline at once
    target_batch_size: int = 32  # samples per optimizer step of each stage
    lr: float = 3e-3  # peak learning rate
    # wire codec for activations and gradients
    codec: str = field(default="none", metadata={"choices": CODEC_NAMES})
    eval_every_steps: int = 100  # validation every this many steps
    workdir: str | None = None  # where the processes' logs go (default: a new temporary folder)
    run_id: str = "demo"  # run id in the DHT

    def __post_init__(self):
        if self.peers_per_stage < 1 or self.steps < 1:
            raise ValueError(
                f"peers_per_stage ({self.peers_per_stage}) and steps ({self.steps}) must be >= 1"
            )


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_demo(config: DemoConfig) -> int:
    from swarm.trainer.trainer import TrainSummary

    # Ctrl-C (SIGINT) and SIGTERM stop every process of the demo. Set here because a process started in the
    # background of a script inherits SIGINT ignored, and Python then leaves it ignored: the demo would keep
    # running, its children with it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    if config.preset not in ALL_PRESETS:
        raise ValueError(f"unknown preset '{config.preset}'; choose one of {sorted(ALL_PRESETS)}")
    num_stages = ALL_PRESETS[config.preset].num_stages
    workdir = Path(config.workdir or tempfile.mkdtemp(prefix="swarm-demo-"))
    print(
        f"swarm demo: 1 bootstrap node, {num_stages} stages x {config.peers_per_stage} peers, 1 trainer "
        f"(logs in {workdir})",
        flush=True,
    )
    started = time.monotonic()
    run_flags = [
        "--preset",
        config.preset,
        "--codec",
        config.codec,
        "--target-batch-size",
        config.target_batch_size,
        "--lr",
        config.lr,
        "--total-steps",
        config.steps,
    ]
    try:
        with LocalSwarm(workdir) as swarm:
            peers = [
                swarm.peer(
                    f"peer-s{stage}-{replica}",
                    stage,
                    *run_flags,
                    *(() if config.average else ("--no-average",)),
                    run_id=config.run_id,
                    wait=False,
                )
                for stage in range(num_stages)
                for replica in range(config.peers_per_stage)
            ]
            for proc in peers:
                swarm.wait_ready(proc, timeout_s=120)
                print(f"  {proc.name} is up (pid {proc.pid})", flush=True)
            trainer = swarm.trainer(
                "trainer",
                run_id=config.run_id,
                steps=config.steps,
                microbatch_size=config.microbatch_size,
                in_flight=config.in_flight,
                eval_every_steps=config.eval_every_steps,
                echo=True,
            )
            code = trainer.popen.wait()
            trainer.reader.join(timeout=10)
            # replicas that step alone never settle at one step: look once
            wait_s = 60.0 if config.average else 0.0
            agree, replicas_line = (
                _replicas_agree(swarm, config.run_id, wait_s=wait_s) if code == 0 else (None, "")
            )
    except KeyboardInterrupt:
        print("\nswarm demo: interrupted, stopping every process", flush=True)
        return 130
    elapsed = time.monotonic() - started
    try:
        summary = TrainSummary.parse("".join(trainer.lines)) if code == 0 else None
    except ValueError:
        summary = None
    if summary is None:
        print(
            f"swarm demo: the trainer failed (exit code {code}); see {workdir}/trainer.log and the peer "
            f"logs next to it",
            file=sys.stderr,
        )
        return 1
    initial, final = summary.initial_loss, summary.final_loss
    print(
        f"\nswarm demo finished in {elapsed:.0f}s: training loss {initial:.3f} -> {final:.3f} "
        f"({100 * final / initial:.0f}% of initial), validation loss {summary.val_loss:.3f}, "
        f"{summary.tokens_per_s:,.0f} tokens/s; all processes stopped",
        flush=True,
    )
    print(
        f"swarm demo: replicas {'agree' if agree else 'DISAGREE' if agree is False else 'unchecked'} "
        f"({replicas_line})",
        flush=True,
    )
    # averaging replicas must hold one model; replicas that step alone legitimately differ
    return 1 if agree is False and config.average else 0


def _replicas_agree(swarm: LocalSwarm, run_id: str, *, wait_s: float):
    """Read ``swarm status --json`` until every stage's replicas have settled at one step with their digests
    (a heartbeat or two after the last batch), then whether they hold the same parameters: (verdict, line)."""
    from swarm.coordinator.agreement import settled_verdict

    deadline = time.monotonic() + wait_s
    while True:
        try:
            verdict, line = settled_verdict(swarm.status(run_id))
        except (RuntimeError, ValueError, KeyError) as e:
            verdict, line = None, f"swarm status failed: {e}"
        if verdict is not None or time.monotonic() > deadline:
            return verdict, line
        time.sleep(1.0)  # the peers re-announce every heartbeat; each read is a new process
