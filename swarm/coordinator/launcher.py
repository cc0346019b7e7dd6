"""Start swarm processes on this machine and always stop them: used by ``swarm demo``, tests, benchmarks.

Each process runs in its own session (process group), so stopping it also stops what it spawned (the
DHT's p2pd daemon). Standard output is read line by line by a thread, copied to a log file and, if asked,
echoed; callers wait for a line matching a pattern (an event with a deadline, no polling of files).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarm.coordinator import forkserver


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | forkserver.ForkedProcess
    log_path: Path
    lines: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)
    reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_for(self, pattern: str, *, timeout_s: float, after_line: int = 0) -> re.Match:
        """Block until a line of output (from line ``after_line`` on) matches ``pattern``; raise if the
        process exits or time runs out."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        seen = after_line
        with self.changed:
            while True:
                for line in self.lines[seen:]:
                    if match := regex.search(line):
                        return match
                seen = len(self.lines)
                if self.reader is not None and not self.reader.is_alive():
                    raise RuntimeError(
                        f"{self.name} exited (code {self.popen.poll()}) before printing "
                        f"/{pattern}/; see {self.log_path}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self.name} did not print /{pattern}/ within {timeout_s:.0f}s; "
                        f"see {self.log_path}"
                    )
                self.changed.wait(left)

    def signal(self, sig: int) -> None:
        """SIGTERM and SIGINT go to the process alone, so it shuts down its children (the DHT process,
        p2pd) in order, and so does SIGUSR1 (a request to the process: `swarm peer` moves; its children would
        die of it); other signals (SIGKILL, SIGSTOP, SIGCONT) go to its whole process group."""
        if not self.alive():
            return
        if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            self.popen.send_signal(sig)
        else:
            os.killpg(self.popen.pid, sig)


class ProcessGroup:
    """A set of child processes with logs under ``workdir``; ``close()`` (or the context) stops them all."""

    def __init__(self, workdir: str | os.PathLike, *, echo: bool = False):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.procs: dict[str, Proc] = {}

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        echo: bool | None = None,
    ) -> Proc:
        if name in self.procs and self.procs[name].alive():
            raise ValueError(f"a process named {name!r} is already running")
        log_path = self.workdir / f"{name}.log"
        log = open(log_path, "a", buffering=1)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        argv = list(argv)
        if argv[:3] == [sys.executable, "-m", "swarm"] and forkserver.enabled():
            # the same process, forked from one that imported torch and hivemind already (tests set this)
            popen = forkserver.shared().start(argv[3:], env=full_env)
        else:
            popen = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                start_new_session=True,
                text=True,
                bufsize=1,
            )
        proc = Proc(name, popen, log_path)
        show = self.echo if echo is None else echo

        def pump() -> None:
            with log:
                for line in popen.stdout:
                    log.write(line)
                    if show:
                        sys.stdout.write(line)
                        sys.stdout.flush()
                    with proc.changed:
                        proc.lines.append(line)
                        proc.changed.notify_all()
            popen.wait()
            with proc.changed:
                proc.changed.notify_all()

        proc.reader = threading.Thread(target=pump, name=f"log-{name}", daemon=True)
        proc.reader.start()
        self.procs[name] = proc
        return proc

    def swarm(self, name: str, *args: str, **kwargs) -> Proc:
        """Start ``python -m swarm ARGS`` with this interpreter."""
        return self.start(name, [sys.executable, "-m", "swarm", *args], **kwargs)

    def stop(self, name: str, *, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        """Signal the process's group and wait; SIGKILL the group if it outlives ``timeout_s``."""
        proc = self.procs[name]
        proc.signal(sig)
        try:
            proc.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._kill_group(proc)
        return proc.popen.returncode

    def stop_all(self, names: list[str] | None = None, *, timeout_s: float = 15.0) -> None:
        """Signal every named process (default: all) at once, then wait for them together, so their
        shutdowns overlap; SIGKILL the groups of any still alive after ``timeout_s``."""
        procs = [self.procs[name] for name in (self.procs if names is None else names)]
        for proc in procs:
            if proc.alive():
                proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self._kill_group(proc)

    def close(self, *, timeout_s: float = 15.0) -> None:
        self.stop_all(timeout_s=timeout_s)
        for proc in self.procs.values():
            if proc.reader is not None:
                proc.reader.join(timeout=5)

    @staticmethod
    def _kill_group(proc: Proc) -> None:
        # The leader may have exited while its children (p2pd) live on in its group: kill the group anyway.
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.popen.poll() is None:
            proc.popen.wait(timeout=10)
