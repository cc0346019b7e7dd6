"""Whether a replica whose call failed UNAVAILABLE is gone (swarm.transport.dial.refuses), as a trainer decides it
before it computes a replica's gradients again elsewhere: a killed process's port refuses connections, a frozen
one's still accepts them (the kernel does, for the process that holds the port). Real processes and sockets on
loopback. Taken for gone, a frozen replica's samples would be computed again and applied twice once it came back."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest
from livepeers import closed_port

from swarm.transport.dial import refuses

pytestmark = pytest.mark.integration

# A process that listens on a loopback port, says which, and then does nothing.
LISTENER = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(16)
print(s.getsockname()[1], flush=True)
time.sleep(600)
"""


@pytest.fixture
def listener():
    proc = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield proc, f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()


def test_a_frozen_process_is_not_gone_and_a_killed_one_is(listener):
    proc, endpoint = listener
    assert asyncio.run(refuses(endpoint, timeout_s=5)) is False
    proc.send_signal(signal.SIGSTOP)
    try:
        assert asyncio.run(refuses(endpoint, timeout_s=5)) is False
    finally:
        proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait(timeout=30)
    assert asyncio.run(refuses(endpoint, timeout_s=5)) is True


@pytest.mark.parametrize(
    "endpoint", ["127.0.0.1:{port}", "[::1]:{port}", "nonsense", "127.0.0.1:0"]
)
def test_a_port_nobody_holds_or_an_endpoint_that_is_none_is_gone(endpoint):
    assert asyncio.run(refuses(endpoint.format(port=closed_port()), timeout_s=5)) is True
