"""Start a swarm's processes (bootstrap, peers, trainers) on this machine: one harness for ``swarm demo``, the
tests and the benchmarks, on loopback or on emulated hosts.

Every process is started through a ``ProcessGroup`` (logs per process, wait for a line with a deadline, always
stopped); ``Where`` says which address it binds and how its argv is wrapped, so the same code runs a process
on 127.0.0.1 or inside an emulated host's network namespace (``Where.on(host)`` with a
``deploy.netns.EmulatedHost``). The trainer's command line is built here alone, from ``TrainerConfig`` field
names (:func:`trainer_argv`); its summary line is read back with ``TrainSummary.parse`` (:func:`finished`).
:class:`LocalSwarm` bundles a bootstrap node with its peers and trainers for the common loopback case.

The trainer's ``--metrics-path`` file (one JSON line per step: cumulative ``tokens_per_s`` and ``time_s`` since
training began, and one per validation) is the measurement source: :func:`read_metrics` parses it and
:class:`Progress` gives tokens and trainer time at any point, so tokens/s over a window is a difference of two
snapshots taken at step boundaries.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.argconfig import config_argv
from swarm.coordinator.launcher import Proc, ProcessGroup

if TYPE_CHECKING:
    from swarm.trainer.trainer import TrainSummary

PEER_READY = r"serves stage (\d+) of run '[^']+' at (\S+)"
BOOTSTRAP_READY = "DHT node is up"
# Every role shares a few cores with the others: one torch thread each.
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
    stage: int | None,
    run_id: str,
    addr_file: Path,
    where: Where = Where(),
    run_flags: Sequence[Any] = (),
) -> Proc:
    """``swarm peer`` for ``stage`` (None: the peer picks one on arrival), with 1 torch thread; ``run_flags``
    (``--preset``, ``--codec``, ...) publish the run if it is new. Does not wait: call :func:`wait_ready` so
    that several peers start in parallel."""
    stage_flags = () if stage is None else ("--stage", stage)
    return group.start(
        name,
        _swarm_argv(
            where,
            "peer",
            "--run-id",
            run_id,
            *stage_flags,
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
    return proc.wait_for(PEER_READY, timeout_s=timeout_s).group(2)


def served_stage(proc: Proc, *, timeout_s: float = 180.0) -> int:
    """Wait for a peer's ready line; returns the stage it serves."""
    return int(proc.wait_for(PEER_READY, timeout_s=timeout_s).group(1))


def trainer_argv(
    *, run_id: str, addr_file: Path, where: Where = Where(), **options: Any
) -> list[str]:
    """The one ``swarm train`` command line: ``options`` are TrainerConfig field names (nested ones too, e.g.
    ``max_bytes``), turned into its flags by the same table that builds the CLI, so a misspelt or removed
    option fails here rather than as an unknown flag in a child's log."""
    # Imported here: the trainer module imports torch, which a harness that only starts processes does not
    # need, and which fixes the caller's torch thread count before it could set OMP_NUM_THREADS.
    from swarm.trainer.trainer import TrainerConfig

    return _swarm_argv(
        where,
        "train",
        *config_argv(
            TrainerConfig,
            run_id=run_id,
            host=where.address,
            initial_peers=(f"@{addr_file}",),
            **options,
        ),
    )


def start_trainer(
    group: ProcessGroup,
    name: str,
    *,
    run_id: str,
    addr_file: Path,
    where: Where = Where(),
    echo: bool | None = None,
    **options: Any,
) -> Proc:
    """``swarm train`` with ``options`` (TrainerConfig field names, see :func:`trainer_argv`; ``steps`` 0 =
    until SIGINT). A ``metrics_path`` left from an earlier run is removed first."""
    if options.get("metrics_path") is not None:
        Path(options["metrics_path"]).unlink(missing_ok=True)
    return group.start(
        name,
        trainer_argv(run_id=run_id, addr_file=addr_file, where=where, **options),
        env=SINGLE_THREAD_ENV,
        echo=echo,
    )


def finished(trainer: Proc, *, timeout_s: float) -> TrainSummary:
    """Wait for a trainer to exit; its summary line, parsed. AssertionError with the log's tail if it exits
    with an error or prints no summary."""
    from swarm.trainer.trainer import TrainSummary

    code = trainer.popen.wait(timeout=timeout_s)
    if trainer.reader is not None:
        trainer.reader.join(timeout=10)  # every line read before the summary is looked for
    tail = trainer.log_path.read_text()[-3000:]
    assert code == 0, f"{trainer.name} exited with {code}:\n{tail}"
    try:
        return TrainSummary.parse("".join(trainer.lines))
    except ValueError as e:
        raise AssertionError(f"{trainer.name}: {e}") from None


class LocalSwarm:
    """A bootstrap DHT node on loopback and the peers and trainers started against it, as separate processes
    in one ProcessGroup (logs in ``workdir``); ``close()`` (or the context) stops every one."""

    def __init__(self, workdir: Path, *, echo: bool = False, wait_s: float = 120.0):
        self.group = ProcessGroup(workdir, echo=echo)
        self.addr_file = Path(workdir) / "bootstrap.addr"
        try:
            start_bootstrap(self.group, self.addr_file, wait_s=wait_s)
        except BaseException:
            self.group.close()
            raise

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def initial_peers(self) -> list[str]:
        """The flags that point a ``swarm`` command at this swarm's bootstrap node."""
        return ["--initial-peers", f"@{self.addr_file}"]

    def peer(
        self, name: str, stage: int | None, *flags: Any, run_id: str = "test", wait: bool = True
    ) -> Proc:
        """``swarm peer`` for ``stage`` (None: it picks one) with extra ``flags``; waits until it serves
        unless ``wait`` is False (then :meth:`wait_ready` it, so that several peers start in parallel)."""
        proc = start_peer(
            self.group, name, stage=stage, run_id=run_id, addr_file=self.addr_file, run_flags=flags
        )
        if wait:
            wait_ready(proc)
        return proc

    wait_ready = staticmethod(wait_ready)

    def status(self, run_id: str = "test", *, timeout_s: float = 60.0) -> dict[str, Any]:
        """``swarm status --json`` of ``run_id`` as a separate process, as a user runs it: the document
        (schema: swarm.coordinator.status). RuntimeError if the command fails."""
        import subprocess

        argv = [sys.executable, "-m", "swarm", "status", "--run-id", run_id, "--json"]
        try:
            done = subprocess.run(
                [*argv, *self.initial_peers],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={**os.environ, **SINGLE_THREAD_ENV},
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"swarm status --run-id {run_id} took over {timeout_s:g}s") from None
        if done.returncode != 0:
            raise RuntimeError(
                f"swarm status --run-id {run_id} failed ({done.returncode}): {done.stderr[-2000:]}"
            )
        return json.loads(done.stdout.splitlines()[-1])

    def trainer(
        self, name: str, *, run_id: str = "test", echo: bool | None = None, **options
    ) -> Proc:
        """``swarm train`` against this swarm; ``options`` are TrainerConfig field names."""
        return start_trainer(
            self.group, name, run_id=run_id, addr_file=self.addr_file, echo=echo, **options
        )

    def addresses(self) -> list[str]:
        """The bootstrap node's multiaddrs."""
        return [line.strip() for line in self.addr_file.read_text().splitlines() if line.strip()]

    def stop_peers(self) -> None:
        """Stop every process but the bootstrap node, together (a frozen one is resumed first so it can
        drain)."""
        names = [
            name for name, proc in self.group.procs.items() if name != "bootstrap" and proc.alive()
        ]
        for name in names:
            self.group.procs[name].signal(signal.SIGCONT)
        self.group.stop_all(names, timeout_s=30)

    def close(self) -> None:
        self.group.close()


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


async def read_peer_addresses(directory, endpoints, *, timeout_s: float = 60.0) -> list:
    """The addresses (:class:`~swarm.transport.security.PeerAddress`) the peers serving at ``endpoints`` announce
    in ``directory``'s run, in order, waiting up to ``timeout_s`` for their records; TimeoutError names the missing
    endpoints."""
    import asyncio
    import time

    from swarm.transport.security import PeerAddress

    endpoints, deadline = list(endpoints), time.monotonic() + timeout_s
    while True:
        run = await directory.get_run()
        found = {}
        if run is not None:
            for records in await directory.all_stages(run.model.num_stages):
                found.update({r.endpoint: PeerAddress.of(r) for r in records.values()})
        missing = [e for e in endpoints if e not in found]
        if not missing:
            return [found[e] for e in endpoints]
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no record of run '{directory.run_id}' names {missing} after {timeout_s:.0f}s"
            )
        # the next heartbeat: records appear in the DHT, nothing to wait on here
        await asyncio.sleep(0.5)


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


def publish_run_at(
    where: Where, addr_file: Path, run_id: str, run, *, timeout_s: float = 120.0
) -> None:
    """:func:`publish_run` from a process run where ``where`` says (e.g. inside an emulated host, which reaches
    the bootstrap node where this process may not); the same swarm package the other processes run."""
    import subprocess

    argv = where.wrap(
        [
            sys.executable,
            "-m",
            "swarm.coordinator.localswarm",
            "publish",
            "--addr-file",
            str(addr_file),
            "--run-id",
            run_id,
            "--config-json",
            json.dumps(run.to_dict()),
        ]
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(
            f"publishing run '{run_id}' failed ({done.returncode}): {done.stderr[-2000:]}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m swarm.coordinator.localswarm publish --addr-file F --run-id R --config-json J``: publish a
    run config from wherever this runs (e.g. inside an emulated host's namespace, where the bootstrap node is
    reachable)."""
    import argparse

    from swarm.config import RunConfig

    parser = argparse.ArgumentParser(prog="python -m swarm.coordinator.localswarm")
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
