"""Emulated slow links between swarm hosts on one machine.

Every emulated host (a peer or a trainer) lives in its own network namespace with one
address; a veth pair joins it to a private bridge. A ``tbf`` qdisc on the namespace side
of the veth limits what the host *sends*, one on the bridge side limits what it
*receives*, so each host has its own up- and downlink like a machine on a home line.

Limits of the emulation: this kernel has ``tbf``/``htb`` but not ``netem``, so links get
a rate but no fixed extra delay, jitter or random loss. Latency comes only from queueing
in the tbf buffer (bounded by ``queue_latency_ms``).

Isolation contract: the bridge gets no address and no route, nothing is NAT-ed and no
iptables rule is touched, so traffic from the namespaces can only reach other namespaces
of the same network. Host addresses come from a private subnet (default 10.213.0.0/24)
that exists only inside the namespaces, so parallel networks may reuse it.

Names are ``<prefix><pid hex>-<counter><role><index>`` (role ``b`` bridge, ``v`` veth on
the bridge side, ``n`` namespace); :func:`cleanup_stale` uses the pid to find leftovers
of crashed runs. Everything needs root (CAP_NET_ADMIN); see :func:`have_netns`.

Usage::

    with EmulatedNetwork(num_hosts=4, rate_mbit=100) as net:
        server = net.hosts[0].popen(["swarm", "dht", "--host", net.hosts[0].address])
        net.hosts[1].set_rate(10, direction="send")   # a slow uplink, at run time

CLI: ``python deploy/netns.py selftest --rate-mbit 20`` measures TCP throughput between
two hosts; ``python deploy/netns.py cleanup`` removes leftovers of crashed runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import itertools
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Literal

MAX_IFNAME_CHARS = 15  # Linux IFNAMSIZ (16) minus the terminating NUL
NAMESPACE_IFNAME = "eth0"  # name of the veth end inside every namespace
_NETNS_RUN_DIR = "/run/netns"
_counter = itertools.count()

Direction = Literal["both", "send", "receive"]


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message holds the command and its stderr."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """Shape of one emulated network. Rates are per host and per direction."""

    num_hosts: int  # hosts, one namespace + one address each
    # Rate of each host's uplink and downlink in 10^6 bit/s of Ethernet frames; one value for
    # every host or one per host; None = unlimited.
    rate_mbit: float | None | tuple[float | None, ...] = None
    name_prefix: str = "sw"  # start of every name made; cleanup_stale(prefix) finds leftovers by it
    subnet: str = "10.213.0.0/24"  # host i gets address i+1; exists only inside the namespaces
    burst_bytes: int | None = None  # tbf bucket size; None = max(32 KiB, 4 ms at the rate)
    queue_latency_ms: float = 50.0  # tbf queue bound: the longest a packet waits before it is dropped
    mtu_bytes: int = 1500  # MTU of the veths and the bridge
    terminate_timeout_s: float = 5.0  # how long popen'ed processes get after SIGTERM before SIGKILL

    def __post_init__(self) -> None:
        if not 1 <= self.num_hosts <= 999:
            raise ValueError(f"num_hosts must be in [1, 999], got {self.num_hosts}")
        if isinstance(self.rate_mbit, Sequence):
            object.__setattr__(self, "rate_mbit", tuple(self.rate_mbit))
            if len(self.rate_mbit) != self.num_hosts:
                raise ValueError(f"rate_mbit has {len(self.rate_mbit)} entries for {self.num_hosts} hosts")
        for rate in self.host_rates_mbit():
            _check_rate(rate)
        if not re.fullmatch(r"[a-z]{1,8}", self.name_prefix):
            raise ValueError(f"name_prefix must be 1-8 lowercase letters, got {self.name_prefix!r}")
        net = ipaddress.ip_network(self.subnet)
        if net.version != 4 or not net.is_private or net.is_loopback:
            raise ValueError(f"subnet must be a private, non-loopback IPv4 network, got {self.subnet}")
        if net.num_addresses - 2 < self.num_hosts:
            raise ValueError(f"subnet {self.subnet} has {net.num_addresses - 2} host addresses "
                             f"for {self.num_hosts} hosts")
        if self.burst_bytes is not None and self.burst_bytes < self.mtu_bytes + 14:
            raise ValueError(f"burst_bytes={self.burst_bytes} is below one frame ({self.mtu_bytes + 14} bytes)")
        if self.queue_latency_ms <= 0:
            raise ValueError(f"queue_latency_ms must be > 0, got {self.queue_latency_ms}")
        if not 576 <= self.mtu_bytes <= 65535:
            raise ValueError(f"mtu_bytes must be in [576, 65535], got {self.mtu_bytes}")
        if self.terminate_timeout_s < 0:
            raise ValueError(f"terminate_timeout_s must be >= 0, got {self.terminate_timeout_s}")

    def host_rates_mbit(self) -> tuple[float | None, ...]:
        """The starting rate of each host."""
        if isinstance(self.rate_mbit, tuple):
            return self.rate_mbit
        return (self.rate_mbit,) * self.num_hosts


def _check_rate(rate_mbit: float | None) -> None:
    if rate_mbit is not None and not 0.01 <= rate_mbit <= 100_000:
        raise ValueError(f"rate must be None (unlimited) or in [0.01, 100000] Mbit/s, got {rate_mbit}")


def _cmd(argv: Sequence[str], *, timeout_s: float = 30.0) -> str:
    """Runs one ip/tc command; raises NetnsError with its stderr when it fails."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"`{' '.join(argv)}` did not finish in {timeout_s} s") from e
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def _namespace_exists(name: str) -> bool:
    return os.path.exists(os.path.join(_NETNS_RUN_DIR, name))


def _delete_link(name: str) -> None:
    # Deleting one end of a veth deletes both ends synchronously; deleting the namespace
    # would only do so later, from a kernel work queue, so veths are deleted explicitly.
    try:
        _cmd(["ip", "link", "del", name])
    except NetnsError:
        if _link_exists(name):  # gone meanwhile (another cleaner, or its veth peer) is fine
            raise


def _namespace_pids(namespace: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30).stdout
    return [int(p) for p in out.split()]


def _delete_namespace(namespace: str, *, wait_s: float = 5.0) -> None:
    """Kills whatever still runs inside (stray children), then removes the namespace."""
    if not _namespace_exists(namespace):
        return
    deadline = time.monotonic() + wait_s
    while pids := _namespace_pids(namespace):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} in namespace {namespace} survived SIGKILL for {wait_s} s")
        time.sleep(0.01)  # SIGKILL is delivered asynchronously; poll until the namespace is empty
    try:
        _cmd(["ip", "netns", "del", namespace])
    except NetnsError:
        if _namespace_exists(namespace):
            raise


def _allocate_tag(prefix: str) -> str:
    """A name stem no live object uses: prefix + pid in hex + per-process counter."""
    for _ in range(1000):
        tag = f"{prefix}{os.getpid():x}-{next(_counter) % 1000}"
        if not _link_exists(f"{tag}b") and not _namespace_exists(f"{tag}n0"):
            return tag
    raise NetnsError(f"no free name with prefix {prefix!r} for pid {os.getpid()} after 1000 tries")


class EmulatedHost:
    """One host: a namespace, its address, its two rate limits and the processes it runs."""

    def __init__(self, *, index: int, namespace: str, bridge_veth: str, address: str,
                 config: NetworkConfig) -> None:
        self.index = index
        self.namespace = namespace  # name for `ip netns exec`
        self.bridge_veth = bridge_veth  # veth end on the bridge side; its egress is this host's downlink
        self.address = address  # IPv4 address of NAMESPACE_IFNAME inside the namespace
        self.send_rate_mbit: float | None = None
        self.receive_rate_mbit: float | None = None
        self._config = config
        self._processes: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return (f"EmulatedHost({self.index}, {self.address}, ns={self.namespace}, "
                f"send={self.send_rate_mbit} Mbit/s, receive={self.receive_rate_mbit} Mbit/s)")

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *map(str, argv)]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts ``argv`` in this namespace in its own session (process group).

        The network terminates the whole group on exit: SIGTERM, then SIGKILL after
        ``terminate_timeout_s``. ``kwargs`` go to ``subprocess.Popen``.
        """
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.exec_argv(argv), **kwargs)
        self._processes.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout_s: float = 60.0, check: bool = True,
            **kwargs) -> subprocess.CompletedProcess:
        """Runs ``argv`` in this namespace to completion (text output captured by default).

        Raises ``subprocess.TimeoutExpired`` after ``timeout_s`` (the child is killed) and
        ``subprocess.CalledProcessError`` on a non-zero exit when ``check``.
        """
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.exec_argv(argv), timeout=timeout_s, check=check, **kwargs)

    def set_rate(self, rate_mbit: float | None, *, direction: Direction = "both") -> None:
        """Limits this host's uplink (``send``), downlink (``receive``) or both, in 10^6 bit/s.

        ``None`` removes the limit. Takes effect at once for traffic already flowing.
        """
        _check_rate(rate_mbit)
        if direction not in ("both", "send", "receive"):
            raise ValueError(f"direction must be 'both', 'send' or 'receive', got {direction!r}")
        if direction in ("both", "send"):
            self._apply(["-n", self.namespace], NAMESPACE_IFNAME, rate_mbit, self.send_rate_mbit)
            self.send_rate_mbit = rate_mbit
        if direction in ("both", "receive"):
            self._apply([], self.bridge_veth, rate_mbit, self.receive_rate_mbit)
            self.receive_rate_mbit = rate_mbit

    def _apply(self, netns_args: list[str], dev: str, rate_mbit: float | None, current: float | None) -> None:
        if rate_mbit is None:
            if current is not None:
                _cmd(["tc", *netns_args, "qdisc", "del", "dev", dev, "root"])
            return
        rate_bit = int(rate_mbit * 1e6)
        # A bucket below a few frames stalls TCP; 32 KiB is ~13 ms at 20 Mbit/s. At high rates
        # the kernel tick and GSO super-frames need more, so it grows to 4 ms of traffic.
        burst = self._config.burst_bytes or max(32 * 1024, rate_bit // 8 * 4 // 1000)
        _cmd(["tc", *netns_args, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bit}bit",
              "burst", str(burst), "latency", f"{self._config.queue_latency_ms}ms"])

    def stop_processes(self) -> None:
        """SIGTERM every process group started by popen, SIGKILL what is left after the bound."""
        live = [p for p in self._processes if p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._config.terminate_timeout_s
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for proc in self._processes:
            # The leader is gone; children it left in its group still get the SIGKILL.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._processes.clear()


class EmulatedNetwork:
    """Context manager: N namespaced hosts on one bridge, rate-limited both ways.

    On exit (also when the body raises) it stops the processes started with ``popen``,
    kills anything else left in the namespaces, and deletes every veth, namespace and the
    bridge it made. Construct with a :class:`NetworkConfig` or its fields as keywords.
    """

    def __init__(self, config: NetworkConfig | None = None, /, **fields) -> None:
        if config is not None and fields:
            raise TypeError("pass either a NetworkConfig or its fields as keywords, not both")
        self.config = config if config is not None else NetworkConfig(**fields)
        self.tag = ""  # name stem of everything this network makes; set on enter
        self.bridge = ""
        self.hosts: list[EmulatedHost] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> EmulatedNetwork:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Idempotent teardown; raises NetnsError only if something could not be removed."""
        try:
            for host in self.hosts:
                host.stop_processes()
        finally:
            self._stack.close()  # LIFO: veths, then namespaces (killing strays), then the bridge

    def created_names(self) -> list[str]:
        """Every namespace and root-namespace link name this network made (for checks)."""
        names = [self.bridge] if self.bridge else []
        for host in self.hosts:
            names += [host.namespace, host.bridge_veth]
        return names

    def _build(self) -> None:
        cfg = self.config
        self.tag = _allocate_tag(cfg.name_prefix)
        longest = f"{self.tag}v{cfg.num_hosts - 1}"
        if len(longest) > MAX_IFNAME_CHARS:
            raise ValueError(f"interface name {longest!r} has {len(longest)} chars, Linux allows "
                             f"{MAX_IFNAME_CHARS}: shorten name_prefix {cfg.name_prefix!r}")
        subnet = ipaddress.ip_network(cfg.subnet)
        has_ipv6 = os.path.exists("/proc/sys/net/ipv6")
        mtu = str(cfg.mtu_bytes)

        self.bridge = f"{self.tag}b"
        # nf_call_* 0: bridged frames skip the host's iptables even if br_netfilter is loaded,
        # so host firewall rules neither drop nor see this traffic.
        _cmd(["ip", "link", "add", self.bridge, "mtu", mtu, "type", "bridge",
              "nf_call_iptables", "0", "nf_call_ip6tables", "0", "nf_call_arptables", "0"])
        self._stack.callback(_delete_link, self.bridge)
        if has_ipv6:  # no IPv6 link-local address (and route) on the host side
            _cmd(["ip", "link", "set", self.bridge, "addrgenmode", "none"])
        _cmd(["ip", "link", "set", self.bridge, "up"])

        for i, rate in enumerate(cfg.host_rates_mbit()):
            host = EmulatedHost(index=i, namespace=f"{self.tag}n{i}", bridge_veth=f"{self.tag}v{i}",
                                address=str(subnet[i + 1]), config=cfg)
            _cmd(["ip", "netns", "add", host.namespace])
            self._stack.callback(_delete_namespace, host.namespace)
            self.hosts.append(host)
            _cmd(["ip", "-n", host.namespace, "link", "set", "lo", "up"])
            _cmd(["ip", "link", "add", host.bridge_veth, "mtu", mtu, "type", "veth",
                  "peer", "name", NAMESPACE_IFNAME, "mtu", mtu, "netns", host.namespace])
            self._stack.callback(_delete_link, host.bridge_veth)
            if has_ipv6:
                _cmd(["ip", "link", "set", host.bridge_veth, "addrgenmode", "none"])
            _cmd(["ip", "link", "set", host.bridge_veth, "master", self.bridge, "up"])
            _cmd(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/{subnet.prefixlen}",
                  "dev", NAMESPACE_IFNAME])
            _cmd(["ip", "-n", host.namespace, "link", "set", NAMESPACE_IFNAME, "up"])
            host.set_rate(rate)


def have_netns() -> tuple[bool, str]:
    """(True, "") when this process can build an EmulatedNetwork, else (False, why).

    Checks root, the ``ip``/``tc`` tools, and that a scratch namespace can be created and
    holds a bridge, a veth pair and a tbf qdisc; the scratch namespace is deleted again.
    """
    if os.geteuid() != 0:
        return False, f"needs root for network namespaces and qdiscs (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not on PATH"
    scratch = f"{_allocate_tag('sw')}n0"
    try:
        _cmd(["ip", "netns", "add", scratch])
    except NetnsError as e:
        return False, f"cannot create a network namespace: {e}"
    try:
        # Everything below lives inside the scratch namespace: the host is not touched.
        _cmd(["ip", "-n", scratch, "link", "add", "probebr", "type", "bridge"])
        _cmd(["ip", "-n", scratch, "link", "add", "probea", "type", "veth", "peer", "name", "probeb"])
        _cmd(["tc", "-n", scratch, "qdisc", "add", "dev", "probea", "root", "tbf",
              "rate", "1mbit", "burst", "32kb", "latency", "50ms"])
    except NetnsError as e:
        return False, f"bridge/veth/tbf unavailable: {e}"
    finally:
        _delete_namespace(scratch)
    return True, ""


def cleanup_stale(prefix: str = "sw") -> list[str]:
    """Removes namespaces and links named by :class:`EmulatedNetwork` whose creator pid is dead.

    Objects of live processes (any pid that still exists) are left alone. Safe to run
    concurrently with other cleaners. Returns the names it found stale and removed.
    """
    pattern = re.compile(rf"{re.escape(prefix)}([0-9a-f]+)-\d+([bvn])\d*")

    def stale(name: str) -> str | None:
        m = pattern.fullmatch(name)
        if m is None:
            return None
        try:
            os.kill(int(m.group(1), 16), 0)
        except ProcessLookupError:
            return m.group(2)
        except PermissionError:
            pass  # exists, owned by someone else: alive
        return None

    links = [line.split(":")[1].strip().split("@")[0] for line in _cmd(["ip", "-o", "link", "show"]).splitlines()]
    namespaces = [line.split()[0] for line in _cmd(["ip", "netns", "list"]).splitlines() if line.strip()]
    removed = []
    # veths first (synchronous removal of both ends), then namespaces, then bridges.
    for name in [n for n in links if stale(n) == "v"]:
        _delete_link(name)
        removed.append(name)
    for name in [n for n in namespaces if stale(n) == "n"]:
        _delete_namespace(name)
        removed.append(name)
    for name in [n for n in links if stale(n) == "b"]:
        _delete_link(name)
        removed.append(name)
    return removed


# --- TCP throughput: a plain socket sender/receiver run inside the namespaces ---------------

_CHUNK_BYTES = 64 * 1024
# A small send buffer keeps the data queued after the sender stops (drained at the link
# rate) short, so a measurement ends soon after duration_s even on slow links.
_SNDBUF_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThroughputResult:
    """What the receiver saw: TCP payload bytes from the first byte to EOF."""

    bytes_received: int
    duration_s: float

    @property
    def mbit_per_s(self) -> float:
        return self.bytes_received * 8 / self.duration_s / 1e6


def measure_tcp_throughput(sender: EmulatedHost, receiver: EmulatedHost, *, duration_s: float = 2.0,
                           max_bytes: int = 256 * 1024 * 1024, timeout_s: float = 30.0) -> ThroughputResult:
    """Streams TCP payload from ``sender`` to ``receiver`` for ``duration_s`` or ``max_bytes``.

    Bounded: the sender stops at whichever limit comes first and both sides are killed
    after ``timeout_s``. Raises NetnsError if the transfer does not complete.
    """
    if duration_s <= 0 or max_bytes <= 0:
        raise ValueError(f"duration_s ({duration_s}) and max_bytes ({max_bytes}) must be > 0")
    script = os.path.abspath(__file__)
    recv = receiver.popen([sys.executable, script, "tcp-recv", "--host", receiver.address,
                           "--timeout-s", str(timeout_s)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(_read_line(recv, timeout_s).split()[1])  # "listening <port>"
        sender.run([sys.executable, script, "tcp-send", "--host", receiver.address, "--port", str(port),
                    "--duration-s", str(duration_s), "--max-bytes", str(max_bytes)], timeout_s=timeout_s)
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


def _selftest(rate_mbit: float | None, seconds: float) -> int:
    ok, why = have_netns()
    if not ok:
        print(f"selftest impossible: {why}", file=sys.stderr)
        return 2
    with EmulatedNetwork(num_hosts=2, rate_mbit=rate_mbit) as net:
        a, b = net.hosts
        print(f"hosts {a.address} ({a.namespace}) and {b.address} ({b.namespace}), "
              f"limit {rate_mbit if rate_mbit is not None else 'unlimited'} Mbit/s each way")
        for src, dst in ((a, b), (b, a)):
            res = measure_tcp_throughput(src, dst, duration_s=seconds)
            print(f"{src.address} -> {dst.address}: {res.mbit_per_s:.1f} Mbit/s of TCP payload "
                  f"({res.bytes_received} bytes in {res.duration_s:.2f} s)")
    print("torn down")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy/netns.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("selftest", help="two hosts, measure TCP throughput both ways, tear down")
    p.add_argument("--rate-mbit", type=float, default=20.0, help="per-host limit; 0 = unlimited")
    p.add_argument("--seconds", type=float, default=3.0, help="duration of each measurement")
    p = sub.add_parser("cleanup", help="remove namespaces/links left by crashed runs")
    p.add_argument("--prefix", default="sw")
    p = sub.add_parser("tcp-recv", help=argparse.SUPPRESS)
    p.add_argument("--host", required=True)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p = sub.add_parser("tcp-send", help=argparse.SUPPRESS)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--duration-s", type=float, required=True)
    p.add_argument("--max-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "selftest":
        return _selftest(args.rate_mbit or None, args.seconds)
    if args.cmd == "cleanup":
        print("\n".join(cleanup_stale(args.prefix)) or "nothing stale")
        return 0
    if args.cmd == "tcp-recv":
        _tcp_recv(args.host, args.timeout_s)
    else:
        _tcp_send(args.host, args.port, args.duration_s, args.max_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
