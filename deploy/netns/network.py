"""Emulated hosts (a namespace, an address, rate limits, the processes it runs) and the network joining them."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Literal

from deploy.netns.commands import (
    MAX_IFNAME_CHARS,
    NAMESPACE_IFNAME,
    allocate_tag,
    delete_link,
    delete_namespace,
    run_cmd,
)

Direction = Literal["both", "send", "receive"]


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
    # tbf queue bound: the longest a packet waits before it is dropped
    queue_latency_ms: float = 50.0
    mtu_bytes: int = 1500  # MTU of the veths and the bridge
    terminate_timeout_s: float = 5.0  # how long popen'ed processes get after SIGTERM before SIGKILL

    def __post_init__(self) -> None:
        if not 1 <= self.num_hosts <= 999:
            raise ValueError(f"num_hosts must be in [1, 999], got {self.num_hosts}")
        if isinstance(self.rate_mbit, Sequence):
            object.__setattr__(self, "rate_mbit", tuple(self.rate_mbit))
            if len(self.rate_mbit) != self.num_hosts:
                raise ValueError(
                    f"rate_mbit has {len(self.rate_mbit)} entries for {self.num_hosts} hosts"
                )
        for rate in self.host_rates_mbit():
            check_rate(rate)
        if not re.fullmatch(r"[a-z]{1,8}", self.name_prefix):
            raise ValueError(f"name_prefix must be 1-8 lowercase letters, got {self.name_prefix!r}")
        net = ipaddress.ip_network(self.subnet)
        if net.version != 4 or not net.is_private or net.is_loopback:
            raise ValueError(
                f"subnet must be a private, non-loopback IPv4 network, got {self.subnet}"
            )
        if net.num_addresses - 2 < self.num_hosts:
            raise ValueError(
                f"subnet {self.subnet} has {net.num_addresses - 2} host addresses "
                f"for {self.num_hosts} hosts"
            )
        if self.burst_bytes is not None and self.burst_bytes < self.mtu_bytes + 14:
            raise ValueError(
                f"burst_bytes={self.burst_bytes} is below one frame ({self.mtu_bytes + 14} bytes)"
            )
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


def check_rate(rate_mbit: float | None) -> None:
    if rate_mbit is not None and not 0.01 <= rate_mbit <= 100_000:
        raise ValueError(
            f"rate must be None (unlimited) or in [0.01, 100000] Mbit/s, got {rate_mbit}"
        )


class EmulatedHost:
    """One host: a namespace, its address, its two rate limits and the processes it runs."""

    def __init__(
        self, *, index: int, namespace: str, bridge_veth: str, address: str, config: NetworkConfig
    ) -> None:
        self.index = index
        self.namespace = namespace  # name for `ip netns exec`
        self.bridge_veth = (
            bridge_veth  # veth end on the bridge side; its egress is this host's downlink
        )
        self.address = address  # IPv4 address of NAMESPACE_IFNAME inside the namespace
        self.send_rate_mbit: float | None = None
        self.receive_rate_mbit: float | None = None
        self._config = config
        self._processes: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return (
            f"EmulatedHost({self.index}, {self.address}, ns={self.namespace}, "
            f"send={self.send_rate_mbit} Mbit/s, receive={self.receive_rate_mbit} Mbit/s)"
        )

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

    def run(
        self, argv: Sequence[str], *, timeout_s: float = 60.0, check: bool = True, **kwargs
    ) -> subprocess.CompletedProcess:
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
        check_rate(rate_mbit)
        if direction not in ("both", "send", "receive"):
            raise ValueError(f"direction must be 'both', 'send' or 'receive', got {direction!r}")
        if direction in ("both", "send"):
            self._apply(["-n", self.namespace], NAMESPACE_IFNAME, rate_mbit, self.send_rate_mbit)
            self.send_rate_mbit = rate_mbit
        if direction in ("both", "receive"):
            self._apply([], self.bridge_veth, rate_mbit, self.receive_rate_mbit)
            self.receive_rate_mbit = rate_mbit

    def _apply(
        self, netns_args: list[str], dev: str, rate_mbit: float | None, current: float | None
    ) -> None:
        if rate_mbit is None:
            if current is not None:
                run_cmd(["tc", *netns_args, "qdisc", "del", "dev", dev, "root"])
            return
        rate_bit = int(rate_mbit * 1e6)
        # A bucket below a few frames stalls TCP; 32 KiB is ~13 ms at 20 Mbit/s. At high rates
        # the kernel tick and GSO super-frames need more, so it grows to 4 ms of traffic.
        burst = self._config.burst_bytes or max(32 * 1024, rate_bit // 8 * 4 // 1000)
        run_cmd(
            [
                "tc",
                *netns_args,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{rate_bit}bit",
                "burst",
                str(burst),
                "latency",
                f"{self._config.queue_latency_ms}ms",
            ]
        )

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
        self.tag = allocate_tag(cfg.name_prefix)
        longest = f"{self.tag}v{cfg.num_hosts - 1}"
        if len(longest) > MAX_IFNAME_CHARS:
            raise ValueError(
                f"interface name {longest!r} has {len(longest)} chars, Linux allows "
                f"{MAX_IFNAME_CHARS}: shorten name_prefix {cfg.name_prefix!r}"
            )
        subnet = ipaddress.ip_network(cfg.subnet)
        has_ipv6 = os.path.exists("/proc/sys/net/ipv6")
        mtu = str(cfg.mtu_bytes)

        self.bridge = f"{self.tag}b"
        # nf_call_* 0: bridged frames skip the host's iptables even if br_netfilter is loaded,
        # so host firewall rules neither drop nor see this traffic.
        run_cmd(
            [
                "ip",
                "link",
                "add",
                self.bridge,
                "mtu",
                mtu,
                "type",
                "bridge",
                "nf_call_iptables",
                "0",
                "nf_call_ip6tables",
                "0",
                "nf_call_arptables",
                "0",
            ]
        )
        self._stack.callback(delete_link, self.bridge)
        if has_ipv6:  # no IPv6 link-local address (and route) on the host side
            run_cmd(["ip", "link", "set", self.bridge, "addrgenmode", "none"])
        run_cmd(["ip", "link", "set", self.bridge, "up"])

        for i, rate in enumerate(cfg.host_rates_mbit()):
            host = EmulatedHost(
                index=i,
                namespace=f"{self.tag}n{i}",
                bridge_veth=f"{self.tag}v{i}",
                address=str(subnet[i + 1]),
                config=cfg,
            )
            run_cmd(["ip", "netns", "add", host.namespace])
            self._stack.callback(delete_namespace, host.namespace)
            self.hosts.append(host)
            run_cmd(["ip", "-n", host.namespace, "link", "set", "lo", "up"])
            run_cmd(
                [
                    "ip",
                    "link",
                    "add",
                    host.bridge_veth,
                    "mtu",
                    mtu,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    NAMESPACE_IFNAME,
                    "mtu",
                    mtu,
                    "netns",
                    host.namespace,
                ]
            )
            self._stack.callback(delete_link, host.bridge_veth)
            if has_ipv6:
                run_cmd(["ip", "link", "set", host.bridge_veth, "addrgenmode", "none"])
            run_cmd(["ip", "link", "set", host.bridge_veth, "master", self.bridge, "up"])
            run_cmd(
                [
                    "ip",
                    "-n",
                    host.namespace,
                    "addr",
                    "add",
                    f"{host.address}/{subnet.prefixlen}",
                    "dev",
                    NAMESPACE_IFNAME,
                ]
            )
            run_cmd(["ip", "-n", host.namespace, "link", "set", NAMESPACE_IFNAME, "up"])
            host.set_rate(rate)
