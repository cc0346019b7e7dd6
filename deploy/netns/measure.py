"""TCP throughput between two emulated hosts, measured with the plain sender/receiver of ``tcpprobe.py``."""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import subprocess
import sys

from deploy.netns.commands import NetnsError
from deploy.netns.network import EmulatedHost


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThroughputResult:
    """What the receiver saw: TCP payload bytes from the first byte to EOF."""

    bytes_received: int
    duration_s: float

    @property
    def mbit_per_s(self) -> float:
        return self.bytes_received * 8 / self.duration_s / 1e6


def measure_tcp_throughput(
    sender: EmulatedHost,
    receiver: EmulatedHost,
    *,
    duration_s: float = 2.0,
    max_bytes: int = 256 * 1024 * 1024,
    timeout_s: float = 30.0,
) -> ThroughputResult:
    """Streams TCP payload from ``sender`` to ``receiver`` for ``duration_s`` or ``max_bytes``.

    Bounded: the sender stops at whichever limit comes first and both sides are killed
    after ``timeout_s``. Raises NetnsError if the transfer does not complete.
    """
    if duration_s <= 0 or max_bytes <= 0:
        raise ValueError(f"duration_s ({duration_s}) and max_bytes ({max_bytes}) must be > 0")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tcpprobe.py")
    recv = receiver.popen(
        [sys.executable, script, "recv", "--host", receiver.address, "--timeout-s", str(timeout_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(_read_line(recv, timeout_s).split()[1])  # "listening <port>"
        sender.run(
            [
                sys.executable,
                script,
                "send",
                "--host",
                receiver.address,
                "--port",
                str(port),
                "--duration-s",
                str(duration_s),
                "--max-bytes",
                str(max_bytes),
            ],
            timeout_s=timeout_s,
        )
        out, _ = recv.communicate(timeout=timeout_s)
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        raise NetnsError(f"throughput {sender.address} -> {receiver.address} failed: {e}") from e
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    return ThroughputResult(**json.loads(out))


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise NetnsError(f"receiver printed nothing in {timeout_s} s")
    return proc.stdout.readline()
