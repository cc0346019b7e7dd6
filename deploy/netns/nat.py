"""A home router for an emulated host: its own namespace between the host and the shared bridge, masquerading.

The router namespace holds the host's public address on its outside leg (``eth0``, on the bridge) and the
gateway of a small private link on its inside leg (``lan0``, a veth pair whose other end is the host's
``eth0``). nftables rules inside the router namespace (never in the machine's own) do what a home router does:

- traffic from the host leaves with the router's public address (masquerade), and its answers come back;
- nothing from outside starts a connection to the host or the router: unsolicited packets are dropped (so a
  dial from outside times out, as most home routers make it), unless the operator forwarded a port
  (:func:`forward_port`, a port forward on the router's web page).

Needs ``nft`` (Debian package ``nftables``) on PATH: :func:`have_nat` says why not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from deploy.apt import AptError, apt_install
from deploy.netns.commands import NAMESPACE_IFNAME, NetnsError, add_veth, run_cmd

ROUTER_INSIDE_IFNAME = "lan0"  # the router's leg towards its host
NAT_TABLE = "swarmnat"  # the nftables tables the router holds (ip, for NAT; inet, for the firewall)


def have_nat() -> tuple[bool, str]:
    """(True, "") when NAT routers can be built (given namespaces, see ``have_netns``), else (False, why). As root
    where ``nft`` is missing, Debian's ``nftables`` is installed first (as deploy/engine.py installs Docker)."""
    if shutil.which("nft") is None and os.geteuid() == 0 and shutil.which("apt-get") is not None:
        with tempfile.NamedTemporaryFile(
            "w", prefix="swarm-apt-nftables-", suffix=".log", delete=False
        ) as log:
            try:
                apt_install(["nftables"], log)
            except (AptError, OSError, subprocess.TimeoutExpired) as e:
                return False, f"`nft` is not on PATH and installing nftables failed: {e}"
    if shutil.which("nft") is None:
        return (
            False,
            "`nft` is not on PATH: emulated NAT routers need nftables (Debian: apt-get install nftables)",
        )
    return True, ""


def _ruleset() -> str:
    out, lan = NAMESPACE_IFNAME, ROUTER_INSIDE_IFNAME
    return f"""
table ip {NAT_TABLE} {{
  chain prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "{out}" masquerade
  }}
}}
table inet {NAT_TABLE} {{
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    ct status dnat accept
    iifname "{lan}" oifname "{out}" accept
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    ct state established,related accept
    iifname "lo" accept
    iifname "{lan}" accept
  }}
}}
"""


def build_router(
    *,
    router_namespace: str,
    host_namespace: str,
    outside: str,
    prefixlen: int,
    gateway: str,
    inside: str,
    mtu: int,
) -> None:
    """Wire ``host_namespace`` behind ``router_namespace``: the router already has its outside leg (``eth0``,
    on the bridge) without an address; this gives it ``outside``/``prefixlen`` (on the bridge's subnet), makes
    the inside link (router ``gateway``, host ``inside``, on a /30), the host's default route through the
    router, and the NAT and firewall rules. Nothing here outlives the two namespaces: deleting them removes the
    inside veth and the rules."""
    r, h = ["ip", "-n", router_namespace], ["ip", "-n", host_namespace]
    run_cmd([*r, "addr", "add", f"{outside}/{prefixlen}", "dev", NAMESPACE_IFNAME])
    run_cmd([*r, "link", "set", NAMESPACE_IFNAME, "up"])
    # The inside veth is made in the router's namespace with its other end sent to the host's: its name there
    # is the host's eth0, as every host has.
    add_veth(
        ROUTER_INSIDE_IFNAME, peer_namespace=host_namespace, mtu=mtu, in_namespace=router_namespace
    )
    run_cmd([*r, "addr", "add", f"{gateway}/30", "dev", ROUTER_INSIDE_IFNAME])
    run_cmd([*r, "link", "set", ROUTER_INSIDE_IFNAME, "up"])
    run_cmd([*h, "addr", "add", f"{inside}/30", "dev", NAMESPACE_IFNAME])
    run_cmd([*h, "link", "set", NAMESPACE_IFNAME, "up"])
    run_cmd([*h, "route", "add", "default", "via", gateway])
    # Forwarding is per namespace: on in the router only (the machine's own setting is untouched).
    run_cmd(["ip", "netns", "exec", router_namespace, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    _nft(router_namespace, _ruleset())


def forward_port(router_namespace: str, *, port: int, inside: str) -> None:
    """A port forward: TCP to the router's public address on ``port`` goes to ``inside``:``port``."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in [1, 65535], got {port}")
    _nft(
        router_namespace,
        f'add rule ip {NAT_TABLE} prerouting iifname "{NAMESPACE_IFNAME}" tcp dport {port} '
        f"dnat to {inside}:{port}\n",
    )


def _nft(namespace: str, script: str) -> None:
    argv = ["ip", "netns", "exec", namespace, "nft", "-f", "-"]
    done = subprocess.run(argv, input=script, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(
            f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}"
        )
