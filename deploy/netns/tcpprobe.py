"""A plain TCP sender and receiver, run inside two namespaces to measure the link between them.

This file runs as a script inside the namespaces (``python tcpprobe.py recv|send ...``, started by
:mod:`deploy.netns.measure`) and imports nothing of the repository, so it works whatever the child's
working directory and path.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

_CHUNK_BYTES = 64 * 1024
# A small send buffer keeps the data queued after the sender stops (drained at the link
# rate) short, so a measurement ends soon after duration_s even on slow links.
_SNDBUF_BYTES = 256 * 1024


def _tcp_recv(host: str, timeout_s: float) -> None:
    with socket.create_server((host, 0)) as server:
        server.settimeout(timeout_s)
        print("listening", server.getsockname()[1], flush=True)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(timeout_s)
        buf = bytearray(_CHUNK_BYTES)
        total = conn.recv_into(buf)
        start = time.monotonic()  # from the first byte: connection setup is not link time
        while n := conn.recv_into(buf):
            total += n
        duration = time.monotonic() - start
    print(json.dumps({"bytes_received": total, "duration_s": duration}), flush=True)


def _tcp_send(host: str, port: int, duration_s: float, max_bytes: int) -> None:
    payload = b"\0" * _CHUNK_BYTES
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF_BYTES)
        sock.connect((host, port))
        deadline = time.monotonic() + duration_s
        sent = 0
        while sent < max_bytes and time.monotonic() < deadline:
            sent += sock.send(payload[: max_bytes - sent])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tcpprobe.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "recv", help="listen, print the port, count bytes to EOF, print a JSON result"
    )
    p.add_argument("--host", required=True)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p = sub.add_parser("send", help="send zeros to HOST:PORT for a time or a byte count")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--duration-s", type=float, required=True)
    p.add_argument("--max-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "recv":
        _tcp_recv(args.host, args.timeout_s)
    else:
        _tcp_send(args.host, args.port, args.duration_s, args.max_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
