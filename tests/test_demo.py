"""`swarm demo` (what `make demo` runs): trains, reports, and leaves no process behind, also on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.swarm


def _sessions_alive(sessions: set[int]) -> list[str]:
    """Processes still running in any of these sessions (each swarm process and its p2pd share one)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields[3] = session id, fields[0] = state
        if int(fields[3]) in sessions and fields[0] != "Z":
            alive.append(f"{entry.name}: {stat[:80]}")
    return alive


def _children(pid: int) -> set[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return {int(p) for p in out.split()}


def _kill_sessions(sessions: set[int]) -> None:
    for session in sessions:
        try:
            os.killpg(session, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start_demo(tmp_path, *args, preexec_fn=None):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swarm",
            "demo",
            "--peers-per-stage",
            "1",
            "--workdir",
            str(tmp_path),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=preexec_fn,
    )


def _read_until(proc, pattern: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"the demo ended before printing /{pattern}/:\n{''.join(lines)}")


def test_demo_trains_reports_and_cleans_up(tmp_path):
    demo = _start_demo(
        tmp_path, "--steps", "12", "--eval-every-steps", "6", "--target-batch-size", "16"
    )
    sessions: set[int] = set()
    try:
        lines = _read_until(demo, r"^step \d+/12")
        sessions = _children(demo.pid)
        assert len(sessions) >= 4  # bootstrap, 2 peers, trainer
        lines.append(demo.communicate(timeout=300)[0])
        assert demo.returncode == 0, "".join(lines)
    finally:
        demo.kill()
        _kill_sessions(sessions)
    text = "".join(lines)
    m = re.search(
        r"training loss ([\d.]+) -> ([\d.]+) \(\d+% of initial\), validation loss ([\d.]+)", text
    )
    assert m, text
    initial, final, val = map(float, m.groups())
    assert final < initial and val > 0
    assert "all processes stopped" in text
    # the summary reads `swarm status --json` and says whether each stage's replicas hold one model
    assert re.search(
        r"replicas agree \(stage 0: 1 replica\(s\) at step 12, same parameters; stage 1: 1 replica\(s\) at "
        r"step 12, same parameters\)",
        text,
    ), text
    assert _sessions_alive(sessions) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_process(tmp_path, sig):
    # Started with SIGINT ignored, as a command run in the background of a script is: the demo still stops
    # on it (Python alone would leave it ignored).
    demo = _start_demo(
        tmp_path,
        "--steps",
        "100000",
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    sessions: set[int] = set()
    try:
        _read_until(demo, r"^step \d+/")
        sessions = _children(demo.pid)
        demo.send_signal(sig)  # SIGINT: what Ctrl-C in a terminal sends to the foreground process
        out, _ = demo.communicate(timeout=120)
    finally:
        demo.kill()
        _kill_sessions(sessions)  # a demo that failed to stop them must not leave them running
    assert demo.returncode == 130, out
    assert "interrupted, stopping every process" in out
    assert _sessions_alive(sessions) == []
