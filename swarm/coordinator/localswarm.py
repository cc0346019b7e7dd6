"""Start a swarm's processes (bootstrap, peers, trainer) for a benchmark or test, on loopback or on emulated hosts.

Shared by ``bench/netswarm.py``, ``bench/quality.py`` and their tests. Every process is started through a
``ProcessGroup`` (logs per process, wait for a line with a deadline, always stopped); ``Where`` says which
address it binds and how its argv is wrapped, so the same code runs a process on 127.0.0.1 or inside an
emulated host's network namespace (``Where.on(host)`` with a ``deploy.netns.EmulatedHost``).

The trainer's ``--metrics-path`` file (one JSON line per step: cumulative ``tokens_per_s`` and ``time_s`` since
training began, and one per validation) is the measurement source: :func:`read_metrics` parses it and
:class:`Progress` gives tokens and trainer time at any point, so tokens/s over a window is a difference of two
snapshots taken at step boundaries.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarm.coordinator.launcher import Proc, ProcessGroup

PEER_READY = r"serves stage \d+ of run '[^']+' at (\S+)"
TRAINER_STEP = r"step \d+"
BOOTSTRAP_READY = "DHT node is up"
# Every role shares a few cores with the others: one torch thread each, as `swarm demo` does.
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1"}


def _identity(argv: list[str]) -> list[str]:
    return argv


@dataclass(frozen=True, kw_only=True)
class Where:
    """Where one process runs: the address it binds and announces, and how its argv is wrapped."""

    # Address the process binds; others dial the same one (gRPC and DHT ports are picked free, and both
    # announce what they bound, so no --announce-host is needed).
    address: str = "127.0.0.1"
    wrap: Callable[[list[str]], list[str]] = _identity  # e.g. EmulatedHost.exec_argv

    @classmethod
    def on(cls, host) -> Where:
        """A process inside emulated host ``host`` (a deploy.netns.EmulatedHost), bound to its address."""
        return cls(address=host.address, wrap=host.exec_argv)


def _swarm_argv(where: Where, *args: str) -> list[str]:
    return where.wrap([sys.executable, "-m", "swarm", *map(str, args)])


def start_bootstrap(
    group: ProcessGroup,
    addr_file: Path,
    *,
    where: Where = Where(),
    name: str = "bootstrap",
    wait_s: float = 120.0,
) -> Proc:
    """A DHT bootstrap node that writes its multiaddrs to ``addr_file``; returns once it is up."""
    addr_file.unlink(missing_ok=True)
    proc = group.start(
        name,
        _swarm_argv(where, "dht", "--host", where.address, "--address-file", addr_file),
        env=SINGLE_THREAD_ENV,
    )
    proc.wait_for(BOOTSTRAP_READY, timeout_s=wait_s)
    return proc


def start_peer(
    group: ProcessGroup,
    name: str,
    *,
    stage: int,
    run_id: str,
    addr_file: Path,
    where: Where = Where(),
    run_flags: Sequence[str] = (),
) -> Proc:
    """``swarm peer`` for ``stage`` (1 torch thread); ``run_flags`` (``--preset``, ``--codec``, ...) publish the
    run if it is new. Does not wait: call :func:`wait_ready` so that several peers start in parallel."""
    return group.start(
        name,
        _swarm_argv(
            where,
            "peer",
            "--run-id",
            run_id,
            "--stage",
            stage,
            "--threads",
            1,
            "--host",
            where.address,
            "--initial-peers",
            f"@{addr_file}",
            *run_flags,
        ),
        env=SINGLE_THREAD_ENV,
    )


def wait_ready(proc: Proc, *, timeout_s: float = 180.0) -> str:
    """Wait for a peer's ready line; returns its gRPC endpoint."""
    return proc.wait_for(PEER_READY, timeout_s=timeout_s).group(1)


def start_trainer(
    group: ProcessGroup,
    name: str,
    *,
    run_id: str,
    addr_file: Path,
    metrics_path: Path,
    steps: int,
    where: Where = Where(),
    flags: Sequence[str] = (),
) -> Proc:
    """``swarm train`` writing ``metrics_path`` (``steps`` 0 = until SIGINT); ``flags`` add trainer options."""
    metrics_path.unlink(missing_ok=True)
    return group.start(
        name,
        _swarm_argv(
            where,
            "train",
            "--run-id",
            run_id,
            "--host",
            where.address,
            "--initial-peers",
            f"@{addr_file}",
            "--steps",
            steps,
            "--metrics-path",
            metrics_path,
            *flags,
        ),
        env=SINGLE_THREAD_ENV,
    )


@dataclass
class Metrics:
    """The trainer's metrics file, parsed."""

    # {"step", "loss", "tokens_per_s", "time_s"} per global batch
    steps: list[dict] = field(default_factory=list)
    validations: list[dict] = field(default_factory=list)  # {"step", "val_loss", "time_s"}

    def progress(self) -> Progress | None:
        """Tokens trained and trainer time at the last completed step (None before the first)."""
        if not self.steps:
            return None
        last = self.steps[-1]
        return Progress(
            step=last["step"], tokens=last["tokens_per_s"] * last["time_s"], time_s=last["time_s"]
        )


@dataclass(frozen=True, kw_only=True)
class Progress:
    step: int  # global batches completed
    tokens: float  # tokens trained since the trainer began
    time_s: float  # trainer time (since training began) at that step

    def tokens_per_s_since(self, earlier: Progress) -> float:
        """Steady-state rate between two snapshots; ValueError if no step completed in between."""
        if self.step <= earlier.step:
            raise ValueError(
                f"no step completed between snapshots (step {earlier.step} -> {self.step})"
            )
        return (self.tokens - earlier.tokens) / (self.time_s - earlier.time_s)


def read_metrics(path: Path) -> Metrics:
    """Parse the metrics JSON lines written so far; a line being written (no newline yet) is ignored."""
    out = Metrics()
    if not path.exists():
        return out
    text = path.read_text()
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        record = json.loads(line)
        (out.validations if "val_loss" in record else out.steps).append(record)
    return out


def publish_run(addr_file: Path, run_id: str, run, *, ttl_s: float = 3600.0) -> None:
    """Publish ``run`` (a swarm.config.RunConfig) under ``run_id`` from a short-lived client DHT node, so peers
    started without ``--preset`` serve a model no preset describes (tests use tiny widths). The record stays
    on the bootstrap node after this node leaves, and the peers refresh it."""
    import asyncio

    from swarm.discovery.dht import DHTConfig, RunDirectory, start_dht

    node = start_dht(DHTConfig(initial_peers=(f"@{addr_file}",)), client_mode=True)
    try:
        if not asyncio.run(RunDirectory(node, run_id).publish_run(run, ttl_s=ttl_s)):
            raise RuntimeError(f"the DHT refused the config record of run '{run_id}'")
    finally:
        node.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/swarmrun.py publish --addr-file F --run-id R --config-json J``: publish a run config from
    wherever this runs (e.g. inside an emulated host's namespace, where the bootstrap node is reachable)."""
    import argparse

    from swarm.config import RunConfig

    parser = argparse.ArgumentParser(prog="bench/swarmrun.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "publish", help="publish a RunConfig (JSON of RunConfig.to_dict()) under a run id"
    )
    p.add_argument("--addr-file", type=Path, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--config-json", required=True)
    args = parser.parse_args(argv)
    publish_run(args.addr_file, args.run_id, RunConfig.from_dict(json.loads(args.config_json)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
