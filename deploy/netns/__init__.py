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

Hosts behind NAT (``nat_hosts``): such a host sits behind a router namespace of its own that holds its public
address on the bridge and masquerades its traffic; nothing from outside can open a connection to it (its router
drops unsolicited packets) unless a port is forwarded (``host.forward_port``). ``host.address`` is where it
listens (private), ``host.public_address`` where others see it come from. See :mod:`.nat`; needs ``nft``.

Names are ``<prefix><pid hex>-<counter><role><index>`` (role ``b`` bridge, ``v`` veth on
the bridge side, ``n`` namespace, ``r`` a NAT router's namespace); :func:`cleanup_stale` uses the pid to find leftovers
of crashed runs. Everything needs root (CAP_NET_ADMIN); see :func:`have_netns`.

Usage::

    with EmulatedNetwork(num_hosts=4, rate_mbit=100) as net:
        server = net.hosts[0].popen(["swarm", "dht", "--host", net.hosts[0].address])
        net.hosts[1].set_rate(10, direction="send")   # a slow uplink, at run time

CLI: ``python -m deploy.netns selftest --rate-mbit 20`` (from the repository root) measures TCP
throughput between two hosts; ``python -m deploy.netns cleanup`` removes leftovers of crashed runs.

Modules: :mod:`.commands` (ip/tc calls, names, probes, cleanup), :mod:`.network` (hosts and the
network), :mod:`.nat` (NAT routers), :mod:`.measure` and ``tcpprobe.py`` (TCP throughput between two hosts),
``__main__`` (the CLI).
"""

from deploy.netns.commands import (
    MAX_IFNAME_CHARS,
    NAMESPACE_IFNAME,
    NetnsError,
    cleanup_stale,
    have_netns,
)
from deploy.netns.measure import ThroughputResult, measure_tcp_throughput
from deploy.netns.nat import have_nat
from deploy.netns.network import Direction, EmulatedHost, EmulatedNetwork, NetworkConfig

__all__ = [
    "MAX_IFNAME_CHARS",
    "NAMESPACE_IFNAME",
    "Direction",
    "EmulatedHost",
    "EmulatedNetwork",
    "NetnsError",
    "NetworkConfig",
    "ThroughputResult",
    "cleanup_stale",
    "have_nat",
    "have_netns",
    "measure_tcp_throughput",
]
