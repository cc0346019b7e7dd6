"""What a Docker daemon killed without its cleanup leaves on the host is removed before the next one starts
(deploy/engine.py): a stale MASQUERADE of a subnet "not out of" a bridge that no longer exists rewrote the source
of every packet between the compose demo's containers once its network came back under another bridge name.
Made here by hand, as a dead daemon leaves them, next to a rule of someone else's that must stay. Needs root and
iptables (the `nat` mark's check); skipped while a daemon runs (its rules would look the same)."""

from __future__ import annotations

import subprocess

import pytest

from deploy.engine import HostNetwork, clear_leftovers

pytestmark = [pytest.mark.nat]

BRIDGE = "br-0000c0ffee00"  # a user network's bridge, as dockerd names one
LEFTOVERS = [
    [
        "-t",
        "nat",
        "-A",
        "POSTROUTING",
        "-s",
        "10.231.0.0/16",
        "!",
        "-o",
        BRIDGE,
        "-j",
        "MASQUERADE",
    ],
    ["-t", "filter", "-A", "FORWARD", "-o", BRIDGE, "-j", "ACCEPT"],
    ["-t", "filter", "-A", "FORWARD", "-j", "DOCKER-LEFTOVER-TEST"],
]
OTHERS = ["-t", "nat", "-A", "POSTROUTING", "-s", "10.232.0.0/16", "-o", "lo", "-j", "RETURN"]


def iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["iptables", *args], capture_output=True, text=True, check=check)


def test_a_dead_daemons_rules_and_bridge_are_removed_and_nothing_else():
    if subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True).returncode == 0:
        pytest.skip("a Docker daemon runs: its rules look like a dead one's, and are its own")
    try:
        subprocess.run(["ip", "link", "add", BRIDGE, "type", "bridge"], check=True)
        iptables("-t", "filter", "-N", "DOCKER-LEFTOVER-TEST")
        for rule in (*LEFTOVERS, OTHERS):
            iptables(*rule)
        removed = clear_leftovers()
        after = HostNetwork.capture()
    finally:
        iptables(*[("-D" if word == "-A" else word) for word in OTHERS], check=False)
        for rule in LEFTOVERS:  # only if the test failed
            iptables(*[("-D" if word == "-A" else word) for word in rule], check=False)
        iptables("-t", "filter", "-X", "DOCKER-LEFTOVER-TEST", check=False)
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)

    assert f"link {BRIDGE}" in removed and BRIDGE not in after.docker_links
    rules = "\n".join(after.rules)
    assert BRIDGE not in rules and "DOCKER-LEFTOVER-TEST" not in rules
    assert (
        "iptables nat -A POSTROUTING -s 10.231.0.0/16 ! -o br-0000c0ffee00 -j MASQUERADE" in removed
    )
    assert ":DOCKER-LEFTOVER-TEST" in "\n".join(removed)
    assert "iptables nat -A POSTROUTING -s 10.232.0.0/16 -o lo -j RETURN" in after.rules
