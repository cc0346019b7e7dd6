"""Hosts behind NAT in the network-emulation harness (deploy/netns/nat.py): out works, in does not.

Real TCP between namespaces: a host behind its own NAT router reaches a host outside (which sees the router's
public address), while nothing outside can open a connection to it, neither at its private address (no route) nor
at its router's public one (the router drops it), until a port is forwarded. Needs root and nftables (markers
netns, nat): skipped with the reason otherwise, a failure under SWARM_REQUIRE_ROOT_TESTS=1 (CI).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from deploy import netns
from tests.test_netns import LIMITED_BAND_MBIT, MEASURE_S, _assert_all_gone

PORT = 5000
# A dial that does not connect within this bound has failed: the routers drop unsolicited packets, so without
# the bound a dial to a NATed host would hang for the kernel's SYN retries (over a minute).
DIAL_TIMEOUT_S = 3.0

_ACCEPT_ONE = (
    "import socket, sys; s = socket.create_server((sys.argv[1], int(sys.argv[2]))); "
    "print('up', flush=True); c, a = s.accept(); print(a[0], flush=True)"
)
# prints "ok" or the error's class name, exits 0 either way
_DIAL = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
    "    print('ok')\n"
    "except OSError as e:\n"
    "    print(type(e).__name__, e.errno)\n"
)


def _listen(host: netns.EmulatedHost) -> subprocess.Popen:
    server = host.popen(
        [sys.executable, "-c", _ACCEPT_ONE, host.address, str(PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout.readline() == "up\n"
    return server


def _dial(src: netns.EmulatedHost, address: str) -> str:
    return src.run(
        [sys.executable, "-c", _DIAL, address, str(PORT), str(DIAL_TIMEOUT_S)],
        timeout_s=DIAL_TIMEOUT_S + 30,
    ).stdout.strip()


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_hosts=2, nat_hosts=(2,)), r"host indices in \[0, 1\], got \(2,\)"),
        (dict(num_hosts=2, nat_hosts=(1, 1)), "distinct"),
        (dict(num_hosts=2, nat_subnet="10.213.0.0/16"), "apart from subnet"),
        (dict(num_hosts=5, nat_hosts=(0,), nat_subnet="172.31.0.0/29"), "2 /30 links for 5 hosts"),
    ],
)
def test_config_rejects_bad_nat_values(fields, message):
    with pytest.raises(ValueError, match=message):
        netns.NetworkConfig(**fields)


@pytest.mark.netns
@pytest.mark.nat
def test_natted_host_dials_out_and_nobody_dials_in():
    with netns.EmulatedNetwork(num_hosts=3, nat_hosts=(1,)) as net:
        names = net.created_names()
        outside, home, other = net.hosts
        assert home.behind_nat and not outside.behind_nat
        assert home.address != home.public_address == "10.213.0.2"
        # Out: the connection succeeds, and the far end sees the router's public address, not the private one.
        server = _listen(outside)
        assert _dial(home, outside.address) == "ok"
        assert server.stdout.readline().strip() == home.public_address
        server.wait(timeout=10)
        # In: a listener on the NATed host is reached from nowhere outside.
        server = _listen(home)
        assert _dial(other, home.address) == "OSError 101"  # ENETUNREACH: private, no route to it
        assert _dial(other, home.public_address) == "TimeoutError None"  # the router drops the SYN
        assert _dial(outside, home.public_address) == "TimeoutError None"
        # ...until the volunteer forwards the port on the router: then the dial gets through, from its source.
        home.forward_port(PORT)
        assert _dial(other, home.public_address) == "ok"
        assert server.stdout.readline().strip() == other.address
    _assert_all_gone(names)
    assert any(name.endswith("r1") for name in names), names


@pytest.mark.netns
@pytest.mark.nat
def test_rate_limits_hold_behind_nat():
    with netns.EmulatedNetwork(num_hosts=2, rate_mbit=20, nat_hosts=(0,)) as net:
        home, outside = net.hosts
        res = netns.measure_tcp_throughput(home, outside, duration_s=MEASURE_S)
        lo, hi = LIMITED_BAND_MBIT
        assert lo <= res.mbit_per_s <= hi, res


def test_forward_port_needs_a_nat_host():
    host = netns.EmulatedHost(
        index=0,
        namespace="x",
        bridge_veth="y",
        address="10.213.0.1",
        config=netns.NetworkConfig(num_hosts=1),
    )
    with pytest.raises(ValueError, match="not behind NAT"):
        host.forward_port(PORT)
