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
    NetnsError,
    add_veth,
    allocate_tag,
    delete_link,
    delete_namespace,
    run_cmd,
)
from deploy.netns.nat import build_router, forward_port, have_nat

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
    # indices of the hosts that sit behind their own NAT router (deploy/netns/nat.py): the router holds the
    # host's public address on the bridge, the host a private one behind it, and nothing from outside gets in
    nat_hosts: tuple[int, ...] = ()
    # private links between NAT routers and their hosts: host i's is the i-th /30 of it
    nat_subnet: str = "172.31.0.0/16"

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
        object.__setattr__(self, "nat_hosts", tuple(self.nat_hosts))
        bad = [i for i in self.nat_hosts if not 0 <= i < self.num_hosts]
        if bad or len(set(self.nat_hosts)) != len(self.nat_hosts):
            raise ValueError(
                f"nat_hosts must be distinct host indices in [0, {self.num_hosts - 1}], "
                f"got {self.nat_hosts}"
            )
        inside = ipaddress.ip_network(self.nat_subnet)
        if inside.version != 4 or not inside.is_private or inside.overlaps(net):
            raise ValueError(
                f"nat_subnet must be a private IPv4 network apart from subnet {self.subnet}, "
                f"got {self.nat_subnet}"
            )
        if self.nat_hosts and inside.num_addresses // 4 < self.num_hosts:
            raise ValueError(
                f"nat_subnet {self.nat_subnet} has {inside.num_addresses // 4} /30 links "
                f"for {self.num_hosts} hosts"
            )

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
        self,
        *,
        index: int,
        namespace: str,
        bridge_veth: str,
        address: str,
        config: NetworkConfig,
        public_address: str | None = None,
        router_namespace: str | None = None,
    ) -> None:
        self.index = index
        self.namespace = namespace  # name for `ip netns exec`
        self.bridge_veth = (
            bridge_veth  # veth end on the bridge side; its egress is this host's downlink
        )
        # IPv4 address of NAMESPACE_IFNAME inside the namespace: where its processes listen. Behind NAT it is a
        # private address no other host can reach.
        self.address = address
        # where other hosts see it come from: its router's address behind NAT, else its own
        self.public_address = public_address or address
        self.router_namespace = (
            router_namespace  # its NAT router's namespace (None: not behind NAT)
        )
        self.send_rate_mbit: float | None = None
        self.receive_rate_mbit: float | None = None
        self._config = config
        self._processes: list[subprocess.Popen] = []

    @property
    def behind_nat(self) -> bool:
        return self.router_namespace is not None

    def forward_port(self, port: int) -> None:
        """Forward TCP ``port`` of its NAT router's public address to the same port here (what a volunteer
        does on a home router's web page). ValueError if the host is not behind NAT."""
        if self.router_namespace is None:
            raise ValueError(f"{self} is not behind NAT: nothing to forward")
        forward_port(self.router_namespace, port=port, inside=self.address)

    def __repr__(self) -> str:
        nat = f" behind NAT as {self.public_address}" if self.behind_nat else ""
        return (
            f"EmulatedHost({self.index}, {self.address}{nat}, ns={self.namespace}, "
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
            if host.router_namespace is not None:
                names.append(host.router_namespace)
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

        if cfg.nat_hosts:
            available, why = have_nat()
            if not available:
                raise NetnsError(why)
        links = ipaddress.ip_network(cfg.nat_subnet).subnets(new_prefix=30)
        for i, (rate, link) in enumerate(zip(cfg.host_rates_mbit(), links)):
            public = str(subnet[i + 1])
            nat = i in cfg.nat_hosts
            host = EmulatedHost(
                index=i,
                namespace=f"{self.tag}n{i}",
                bridge_veth=f"{self.tag}v{i}",
                address=str(link[2]) if nat else public,
                public_address=public,
                router_namespace=f"{self.tag}r{i}" if nat else None,
                config=cfg,
            )
            self._add_namespace(host.namespace)
            self.hosts.append(host)
            # the namespace on the bridge: the host's own, or its router's
            outer = host.router_namespace or host.namespace
            if nat:
                self._add_namespace(outer)
            add_veth(host.bridge_veth, peer_namespace=outer, mtu=cfg.mtu_bytes)
            self._stack.callback(delete_link, host.bridge_veth)
            if has_ipv6:
                run_cmd(["ip", "link", "set", host.bridge_veth, "addrgenmode", "none"])
            run_cmd(["ip", "link", "set", host.bridge_veth, "master", self.bridge, "up"])
            if nat:
                build_router(
                    router_namespace=outer,
                    host_namespace=host.namespace,
                    outside=public,
                    prefixlen=subnet.prefixlen,
                    gateway=str(link[1]),
                    inside=host.address,
                    mtu=cfg.mtu_bytes,
                )
            else:
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
            # Behind NAT the uplink limit sits on the host's own eth0 (its leg to the router), the downlink's
            # on the bridge side as for every host: the router's forwarding is not a bottleneck.
            host.set_rate(rate)

    def _add_namespace(self, name: str) -> None:
        run_cmd(["ip", "netns", "add", name])
        self._stack.callback(delete_namespace, name)
        run_cmd(["ip", "-n", name, "link", "set", "lo", "up"])
