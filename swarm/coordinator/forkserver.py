"""Start ``python -m swarm`` processes by forking a server that has imported torch, hivemind and swarm already.

A fresh ``python -m swarm peer`` spends about 4.5 CPU-seconds importing before it does anything (torch, hivemind,
scipy through hivemind's averager, grpc); a test that starts six processes at once on 2 cores waits ~14 s for
imports alone. The fork server pays that once: :class:`ForkServer` starts one server process, which imports the
modules every command needs and then forks a child per request. The child is a real process in its own session,
with the environment, working directory, argv and standard output (a pipe) the caller gave; only its imports are
shared, copy-on-write. :class:`ForkedProcess` gives the caller what :class:`subprocess.Popen` would (pid, stdout,
poll, wait, send_signal, returncode), so :class:`swarm.coordinator.launcher.ProcessGroup` treats both alike.

Opt-in (:func:`enable`, or ``SWARM_FORK_SERVER=1`` for the tests; ``SWARM_FORK_SERVER=0`` turns it
off): ``swarm demo`` and the benchmarks start plain processes, whose start-up cost is part of what they show.

The server is single-threaded (it forks; a forking process must not run other Python threads), serves requests
from one select loop and reports each child's exit status on the connection that asked for it. It exits when its
caller's end of its stdin closes (the caller exited, however), so it never outlives the process that started it;
children outlive it only as long as their process group does (the launcher kills groups).

Wire format, each way on a Unix stream socket: one JSON line. Request ``{"argv": [...], "env": {...}, "cwd": ...}``
with the write end of the child's stdout pipe passed as SCM_RIGHTS; replies ``{"pid": N}`` once forked and
``{"exit": code}`` (Popen's convention: -N for signal N) when the child ends, or ``{"error": "..."}``.
"""

from __future__ import annotations

import array
import importlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

ENV = "SWARM_FORK_SERVER"
# What `swarm peer`, `swarm train`, `swarm dht` and `swarm status` import before they serve; the server imports them
# once (a module that fails to import is left to the child, which then reports it as a fresh process would).
PRELOAD = (
    "torch",
    "grpc",
    "uvloop",
    "hivemind",
    "swarm.cli",
    "swarm.discovery.dht",
    "swarm.peer.config",
    "swarm.peer.heap",
    "swarm.peer.lifecycle",
    "swarm.trainer.trainer",
    "swarm.coordinator.status",
)


_enabled = False


def enable() -> None:
    """Fork this process's ``python -m swarm`` children from now on. Unlike setting
    ``SWARM_FORK_SERVER=1``, it is not inherited: a ``swarm demo`` a test starts still starts plain processes."""
    global _enabled
    _enabled = True


def enabled() -> bool:
    if os.environ.get(ENV) == "0":
        return False
    return _enabled or os.environ.get(ENV, "") not in ("", "0")


# --- the server -----------------------------------------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict, int]:
    """One request line and the one file descriptor that came with it."""
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        msg, ancdata, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(fds.itemsize))
        if not msg:
            raise ConnectionError("the caller closed the connection mid-request")
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        data += msg
    if len(fds) != 1:
        raise ValueError(
            f"a request carries one file descriptor (the child's stdout), not {len(fds)}"
        )
    return json.loads(data), fds[0]


def _send(conn: socket.socket, **reply) -> None:
    try:
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:
        pass  # the caller is gone; its children are its group's to stop


def _run_child(request: dict, stdout_fd: int, close_fds: list[int]) -> None:
    """In the forked child: become the process the caller asked for, run it, never return."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(stdout_fd, 1)
        os.dup2(stdout_fd, 2)
        os.close(devnull)
        os.close(stdout_fd)
        for stream in (
            sys.stdout,
            sys.stderr,
        ):  # as PYTHONUNBUFFERED would: the launcher reads lines as they come
            stream.reconfigure(line_buffering=True, write_through=True)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [sys.executable, *request["argv"]]
        _reseed()
        _own_process_locks()
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
        from swarm.cli import main

        code = main(list(request["argv"]))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # the child's own failure: print it as Python would, then exit
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code if isinstance(code, int) else 1)


def _reseed() -> None:
    """Forked children share the server's random state: give each its own, as a fresh process has. (Python's
    ``random`` reseeds itself after a fork; numpy's and torch's global generators do not.)"""
    seed = int.from_bytes(os.urandom(4), "little")
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


def _own_process_locks() -> None:
    """Give the child its own copies of the process-wide locks hivemind creates at import. They are POSIX semaphores:
    forked from the server, every child shared the server's, so a child frozen (SIGSTOP) while holding one stalled
    the others' hivemind futures and averaging (tests/test_averaging.py's frozen replica, while a fresh process
    would have its own)."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # its own locks (MPFuture's two, SharedBytes') and backend thread
    wrappers = sys.modules.get("hivemind.utils.asyncio")
    if wrappers is not None:
        import multiprocessing

        wrappers._AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def serve(path: str) -> int:
    """The server's loop: import, then fork one child per request until stdin closes."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the child imports it again and fails as a fresh process would
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wakeup fd
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # the caller's Ctrl-C is for the caller; stdin EOF stops us
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "caller")
    children: dict[int, socket.socket] = {}
    conns: set[socket.socket] = set()
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "caller":
                if not os.read(sys.stdin.fileno(), 4096):
                    listener.close()
                    return 0
            elif key.data == "accept":
                conn, _ = listener.accept()
                conns.add(conn)
                selector.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "request":
                conn = key.fileobj
                selector.unregister(conn)
                try:
                    request, stdout_fd = _recv_request(conn)
                except (OSError, ValueError, ConnectionError) as e:
                    _send(conn, error=str(e))
                    conns.discard(conn)
                    conn.close()
                    continue
                # (fd 0, the caller's pipe, is replaced by /dev/null in the child)
                own = [listener.fileno(), wake_r, wake_w, selector.fileno()]
                own += [c.fileno() for c in conns]
                pid = os.fork()
                if pid == 0:
                    _run_child(request, stdout_fd, own)
                os.close(stdout_fd)
                children[pid] = conn
                _send(conn, pid=pid)
            elif key.data == "child":
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                _reap(children, conns)


def _reap(children: dict[int, socket.socket], conns: set[socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            _send(conn, exit=os.waitstatus_to_exitcode(status))
            conns.discard(conn)
            conn.close()


# --- the caller's side ----------------------------------------------------------------------------------------


class ForkedProcess:
    """A child of the fork server, with the part of :class:`subprocess.Popen` the launcher uses."""

    def __init__(self, argv: Sequence[str], pid: int, conn: socket.socket, stdout):
        self.args = list(argv)
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""
        self._lock = threading.Lock()
        self._server_gone = False

    def _read_exit(self, timeout: float | None) -> None:
        """Read the server's exit report, waiting up to ``timeout`` (None: forever). Several threads may wait at once
        (the launcher's log reader waits while the caller polls): they select without the lock and read under it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._server_gone:
                # the server died before the child: the child is not this process's to reap, so no status comes;
                # once it ends, report a generic failure
                if _ended(self.pid, left):
                    self.returncode = 1
                return
            readable, _, _ = select.select([self._conn], [], [], left)
            with self._lock:
                if self.returncode is not None:
                    return
                if readable:
                    try:
                        chunk = self._conn.recv(4096, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        chunk = None  # another thread read it first
                    if chunk == b"":
                        self._server_gone = True
                        continue
                    self._buffer += chunk or b""
                    if b"\n" in self._buffer:
                        reply = json.loads(self._buffer.split(b"\n", 1)[0])
                        self.returncode = int(reply["exit"])
                        return
            if not readable and left == 0.0:
                return

    def poll(self) -> int | None:
        self._read_exit(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_exit(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _ended(pid: int, timeout: float | None) -> bool:
    """Whether process ``pid`` (not this process's child) ends within ``timeout`` seconds (None: however long)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        # a pidfd turns readable when its process ends
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


class ForkServer:
    """One fork server for this process, started on first use (:func:`shared`)."""

    def __init__(self):
        self._dir = tempfile.mkdtemp(prefix="swarm-forkserver-")
        self.path = str(Path(self._dir) / "sock")
        self._server = subprocess.Popen(
            [sys.executable, "-m", "swarm.coordinator.forkserver", self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self._server.stdout.readline()
        if line.strip() != "ready":
            self._server.kill()
            raise RuntimeError(f"the fork server did not start (it said {line!r})")

    def alive(self) -> bool:
        return self._server.poll() is None

    def start(
        self, argv: Sequence[str], *, env: dict[str, str], cwd: str | None = None
    ) -> ForkedProcess:
        """Fork ``python -m swarm ARGV`` (``argv`` without the interpreter and ``-m swarm``); its stdout and
        stderr go to a pipe whose read end is the returned process's ``stdout`` (text, line-buffered)."""
        read_fd, write_fd = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = json.dumps({"argv": list(argv), "env": env, "cwd": cwd or os.getcwd()})
            conn.sendmsg(
                [request.encode() + b"\n"],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [write_fd]))],
            )
        except BaseException:
            os.close(read_fd)
            conn.close()
            raise
        finally:
            os.close(write_fd)
        conn.settimeout(60.0)
        data = b""
        try:
            while b"\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    raise RuntimeError("the fork server closed the connection before forking")
                data += chunk
        except BaseException:
            os.close(read_fd)
            conn.close()
            raise
        line, rest = data.split(b"\n", 1)
        reply = json.loads(line)
        if "pid" not in reply:
            os.close(read_fd)
            conn.close()
            raise RuntimeError(f"the fork server refused: {reply.get('error')}")
        conn.settimeout(None)  # the exit report is read with select (ForkedProcess._read_exit)
        stdout = open(read_fd, buffering=1, errors="replace")
        proc = ForkedProcess(["-m", "swarm", *argv], reply["pid"], conn, stdout)
        proc._buffer = rest
        return proc

    def close(self) -> None:
        if self._server.poll() is None:
            self._server.stdin.close()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def shared() -> ForkServer:
    """This process's fork server, started on first use (again if it died) and stopped at exit."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive():
            import atexit

            _shared = ForkServer()
            atexit.register(_shared.close)
        return _shared


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
