"""Probe: can hivemind 1.1.12's p2pd carry a stream to a host behind NAT through a circuit relay, on the harness?

An experiment for issue 16's relayed data plane, kept so that its findings (docs/nat.md) can be re-run, not a part of
swarm. Three hosts: a relay with a public address, a server behind its own NAT router and a client behind another.
The server runs hivemind.P2P with auto-relay and the relay as its static relay, and serves an echo over a libp2p
binary stream; the client, also behind NAT, opens that stream by the server's peer id and times a 4 MiB echo.

Run as root from the repository root: ``python -m deploy.netns.relay_probe [--rate-mbit 20] [--wait-s 240]``;
``PROBE_RELAY_LIMITS=relayService=1,relayDataLimit=4294967296`` passes those p2pd flags to the relay.
Each process prints what it sees; the relay logs its reservations and relayed connections (go-libp2p debug).

Why the bridge gets a public-looking subnet (5.6.7.0/24, which exists only inside the namespaces: the bridge has
no way out): go-libp2p's autorelay drops relay addresses that are private, so with the harness's default 10.213/16
no circuit address is ever built.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import selectors
import subprocess
import sys
import threading
import time

from swarm.deadline import timeout

RELAY_PORT = 7100
HANDLER = "swarm-echo"
PAYLOAD_BYTES = 4 << 20
# go-libp2p debug logs of the relay machinery only (the rest is noise)
GOLOG = "info,relay=debug,p2p-circuit=debug,autorelay=debug"


async def _node(role: str, host: str, relay: str, server_id: str, wait_s: float) -> None:
    from hivemind.p2p import P2P, PeerID

    quiet = dict(auto_nat=False, nat_port_map=False, use_relay=True)
    if role == "relay" and os.environ.get("PROBE_RELAY_LIMITS"):
        # hivemind's P2P.create has no argument for the relay service's limits: append the daemon's flags through
        # its private argument builder (probe only)
        build = P2P._make_process_args
        extra = dict(arg.split("=") for arg in os.environ["PROBE_RELAY_LIMITS"].split(","))
        P2P._make_process_args = staticmethod(lambda *a, **kw: build(*a, **kw, **extra))
    if role == "relay":
        p2p = await P2P.create(
            host_maddrs=[f"/ip4/{host}/tcp/{RELAY_PORT}"], force_reachability="public", **quiet
        )
        print("RELAY", p2p.peer_id, flush=True)
        await asyncio.sleep(3600)
    common = dict(
        initial_peers=[relay],
        host_maddrs=[f"/ip4/{host}/tcp/0"],
        force_reachability="private",
        **quiet,
    )
    if role == "server":
        p2p = await P2P.create(use_auto_relay=True, trusted_relays=[relay], **common)

        async def echo(_info, reader, writer):
            while data := await reader.read(1 << 20):
                writer.write(data)
                await writer.drain()
            writer.close()

        await p2p.add_binary_stream_handler(HANDLER, echo)
        print("SERVER", p2p.peer_id, flush=True)
        start = time.monotonic()
        while time.monotonic() - start < wait_s:
            maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
            if any("p2p-circuit" in m for m in maddrs):
                break
            await asyncio.sleep(1.0)
        print("ADDRS", round(time.monotonic() - start), maddrs, flush=True)
        await asyncio.sleep(3600)
    p2p = await P2P.create(**common)
    start = time.monotonic()
    try:
        async with timeout(60):
            _, reader, writer = await p2p.call_binary_stream_handler(
                PeerID.from_base58(server_id), HANDLER
            )
            print("OPENED", round(time.monotonic() - start, 1), flush=True)
            writer.write(b"x" * PAYLOAD_BYTES)
            await writer.drain()
            got = 0
            while got < PAYLOAD_BYTES and (chunk := await reader.read(1 << 20)):
                got += len(chunk)
        elapsed = time.monotonic() - start
        print("ECHO", got, f"{2 * got * 8 / elapsed / 1e6:.1f} Mbit/s both ways", flush=True)
    except Exception as e:  # noqa: BLE001 (a probe reports whatever happened)
        print("FAILED", round(time.monotonic() - start, 1), repr(e)[:400], flush=True)
    await p2p.shutdown()


def _wait_line(proc: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if sel.select(left) and (line := proc.stdout.readline()):
                if line.startswith(prefix):
                    print(line.rstrip()[:400], flush=True)
                    return line
            elif proc.poll() is not None:
                break
    raise RuntimeError(f"no {prefix!r} line within {timeout_s:g}s")


def _echo_lines(proc: subprocess.Popen, tag: str) -> None:
    for line in proc.stdout:
        if any(word in line for word in ("relay", "reserv", "circuit")) and "IPv6" not in line:
            print(f"{tag}> {line.rstrip()[:300]}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.netns.relay_probe")
    parser.add_argument("--rate-mbit", type=float, default=None)
    parser.add_argument(
        "--wait-s", type=float, default=240.0, help="how long the server waits for a relay"
    )
    parser.add_argument(
        "--node", nargs=4, metavar=("ROLE", "HOST", "RELAY", "SERVER_ID"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.node:
        asyncio.run(_node(*args.node, wait_s=args.wait_s))
        return 0
    from deploy.netns import EmulatedNetwork, NetworkConfig

    config = NetworkConfig(num_hosts=3, nat_hosts=(1, 2), rate_mbit=args.rate_mbit)
    object.__setattr__(config, "subnet", "5.6.7.0/24")  # see the module docstring
    # hivemind passes on the daemon's log lines at its own level: DEBUG, for the relay's reservation lines
    env = {**os.environ, "GOLOG_LOG_LEVEL": GOLOG, "HIVEMIND_LOGLEVEL": "DEBUG"}
    me = [sys.executable, "-m", "deploy.netns.relay_probe", "--wait-s", str(args.wait_s), "--node"]
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    with EmulatedNetwork(config) as net:
        r, s, c = net.hosts
        relay = r.popen([*me, "relay", r.address, "-", "-"], **pipe)
        relay_id = _wait_line(relay, "RELAY", 120).split()[1]
        relay_maddr = f"/ip4/{r.address}/tcp/{RELAY_PORT}/p2p/{relay_id}"
        threading.Thread(target=_echo_lines, args=(relay, "relay"), daemon=True).start()
        server = s.popen([*me, "server", s.address, relay_maddr, "-"], **pipe)
        server_id = _wait_line(server, "SERVER", 120).split()[1]
        _wait_line(server, "ADDRS", args.wait_s + 30)
        client = c.popen([*me, "client", c.address, relay_maddr, server_id], **pipe)
        _wait_line(client, ("ECHO", "FAILED"), 120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
