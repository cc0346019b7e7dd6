"""The fork server the suite starts its `python -m swarm` processes from (swarm.coordinator.forkserver): a forked
child is a real process with the caller's argv, environment, working directory and output, in its own session,
whose exit code and signals the launcher sees as a fresh process's."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from swarm.coordinator import forkserver
from swarm.coordinator.launcher import ProcessGroup

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server():
    return (
        forkserver.shared()
    )  # the suite's own (one per test process: each costs the imports once)


def test_a_forked_child_runs_the_command_with_the_callers_env_cwd_and_output(server, tmp_path):
    env = {**os.environ, "SWARM_LOG_LEVEL": "WARNING", "FORKSERVER_PROBE": "seen"}
    proc = server.start(["--version"], env=env, cwd=str(tmp_path))
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 0
    assert out.startswith("swarm "), out
    # a failing command: its exit code and its message come back as a fresh process's would
    bad = server.start(["peer", "--no-such-flag"], env=env, cwd=str(tmp_path))
    err = bad.stdout.read()
    assert bad.wait(timeout=60) == 2
    assert "--no-such-flag" in err


def test_signals_reach_the_child_and_its_exit_status_says_which(server, tmp_path):
    proc = server.start(
        ["dht", "--host", "127.0.0.1", "--address-file", str(tmp_path / "addr")],
        env=dict(os.environ),
        cwd=str(tmp_path),
    )
    assert "DHT node is up" in proc.stdout.readline()
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert os.getpgid(proc.pid) == proc.pid  # a session (and group) of its own
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL


def test_the_launcher_forks_swarm_commands_when_enabled(monkeypatch, tmp_path):
    monkeypatch.setenv(forkserver.ENV, "1")
    with ProcessGroup(tmp_path) as group:
        proc = group.swarm("version", "--version")
        assert isinstance(proc.popen, forkserver.ForkedProcess)
        proc.wait_for(r"^swarm ", timeout_s=60)
        assert proc.popen.wait(timeout=60) == 0
        # anything but `python -m swarm` (here another interpreter command) starts as a plain process
        plain = group.start("plain", [sys.executable, "-c", "print('plain')"])
        assert isinstance(plain.popen, subprocess.Popen)
        plain.wait_for("plain", timeout_s=60)


def test_the_server_exits_with_its_caller(tmp_path):
    caller = subprocess.run(
        [
            sys.executable,
            "-c",
            "from swarm.coordinator import forkserver; s = forkserver.ForkServer(); print(s._server.pid)",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert caller.returncode == 0, caller.stderr
    server_pid = int(caller.stdout.split()[-1])
    # its stdin (the caller's pipe) closed with the caller, without close(): it exits (a pidfd turns readable then)
    try:
        pidfd = os.pidfd_open(server_pid)
    except ProcessLookupError:
        return  # gone already
    try:
        readable, _, _ = select.select([pidfd], [], [], 60)
        assert readable, f"the fork server {server_pid} outlived its caller by 60 s"
    finally:
        os.close(pidfd)


def test_a_child_that_outlives_its_server_still_reports_its_end(tmp_path):
    own, proc = forkserver.ForkServer(), None
    try:
        proc = own.start(
            ["dht", "--host", "127.0.0.1", "--address-file", str(tmp_path / "addr")],
            env=dict(os.environ),
            cwd=str(tmp_path),
        )
        assert "DHT node is up" in proc.stdout.readline()
        own._server.kill()
        own._server.wait(timeout=30)
        # no exit report can come now; polling does not block, and the running child is not reported ended
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # the group: the DHT runs in a process of its own
        assert proc.wait(timeout=60) == 1  # ended, its status unknown (it was the server's child)
    finally:
        if proc is not None and proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
        own.close()
