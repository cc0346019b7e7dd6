"""The ip/tc commands the harness runs, the names it gives, and the checks and cleanup around them."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

MAX_IFNAME_CHARS = 15  # Linux IFNAMSIZ (16) minus the terminating NUL
NAMESPACE_IFNAME = "eth0"  # name of the veth end inside every namespace
_NETNS_RUN_DIR = "/run/netns"
_counter = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message holds the command and its stderr."""


def run_cmd(argv: Sequence[str], *, timeout_s: float = 30.0) -> str:
    """Runs one ip/tc command; raises NetnsError with its stderr when it fails."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"`{' '.join(argv)}` did not finish in {timeout_s} s") from e
    if done.returncode != 0:
        raise NetnsError(
            f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


def add_veth(name: str, *, peer_namespace: str, mtu: int, in_namespace: str | None = None) -> None:
    """A veth pair: ``name`` in ``in_namespace`` (None: the machine's own), its other end NAMESPACE_IFNAME in
    ``peer_namespace``."""
    where = [] if in_namespace is None else ["-n", in_namespace]
    run_cmd(
        ["ip", *where, "link", "add", name, "mtu", str(mtu), "type", "veth"]
        + ["peer", "name", NAMESPACE_IFNAME, "mtu", str(mtu), "netns", peer_namespace]
    )


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def namespace_exists(name: str) -> bool:
    return os.path.exists(os.path.join(_NETNS_RUN_DIR, name))


def delete_link(name: str) -> None:
    # Deleting one end of a veth deletes both ends synchronously; deleting the namespace
    # would only do so later, from a kernel work queue, so veths are deleted explicitly.
    try:
        run_cmd(["ip", "link", "del", name])
    except NetnsError:
        if link_exists(name):  # gone meanwhile (another cleaner, or its veth peer) is fine
            raise


def namespace_pids(namespace: str) -> list[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30
    ).stdout
    return [int(p) for p in out.split()]


def delete_namespace(namespace: str, *, wait_s: float = 5.0) -> None:
    """Kills whatever still runs inside (stray children), then removes the namespace."""
    if not namespace_exists(namespace):
        return
    deadline = time.monotonic() + wait_s
    while pids := namespace_pids(namespace):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise NetnsError(
                f"processes {pids} in namespace {namespace} survived SIGKILL for {wait_s} s"
            )
        time.sleep(0.01)  # SIGKILL is delivered asynchronously; poll until the namespace is empty
    try:
        run_cmd(["ip", "netns", "del", namespace])
    except NetnsError:
        if namespace_exists(namespace):
            raise


def allocate_tag(prefix: str) -> str:
    """A name stem no live object uses: prefix + pid in hex + per-process counter."""
    for _ in range(1000):
        tag = f"{prefix}{os.getpid():x}-{next(_counter) % 1000}"
        if not link_exists(f"{tag}b") and not namespace_exists(f"{tag}n0"):
            return tag
    raise NetnsError(f"no free name with prefix {prefix!r} for pid {os.getpid()} after 1000 tries")


def have_netns() -> tuple[bool, str]:
    """(True, "") when this process can build an EmulatedNetwork, else (False, why).

    Checks root, the ``ip``/``tc`` tools, and that a scratch namespace can be created and
    holds a bridge, a veth pair and a tbf qdisc; the scratch namespace is deleted again.
    """
    if os.geteuid() != 0:
        return (
            False,
            f"needs root for network namespaces and qdiscs (running as uid {os.geteuid()})",
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not on PATH"
    scratch = f"{allocate_tag('sw')}n0"
    try:
        run_cmd(["ip", "netns", "add", scratch])
    except NetnsError as e:
        return False, f"cannot create a network namespace: {e}"
    try:
        # Everything below lives inside the scratch namespace: the host is not touched.
        run_cmd(["ip", "-n", scratch, "link", "add", "probebr", "type", "bridge"])
        run_cmd(
            ["ip", "-n", scratch, "link", "add", "probea", "type", "veth", "peer", "name", "probeb"]
        )
        run_cmd(
            [
                "tc",
                "-n",
                scratch,
                "qdisc",
                "add",
                "dev",
                "probea",
                "root",
                "tbf",
                "rate",
                "1mbit",
                "burst",
                "32kb",
                "latency",
                "50ms",
            ]
        )
    except NetnsError as e:
        return False, f"bridge/veth/tbf unavailable: {e}"
    finally:
        delete_namespace(scratch)
    return True, ""


def cleanup_stale(prefix: str = "sw") -> list[str]:
    """Removes namespaces and links named by :class:`EmulatedNetwork` whose creator pid is dead.

    Objects of live processes (any pid that still exists) are left alone. Safe to run
    concurrently with other cleaners. Returns the names it found stale and removed.
    """
    pattern = re.compile(rf"{re.escape(prefix)}([0-9a-f]+)-\d+([bvnr])\d*")

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

    links = [
        line.split(":")[1].strip().split("@")[0]
        for line in run_cmd(["ip", "-o", "link", "show"]).splitlines()
    ]
    namespaces = [
        line.split()[0] for line in run_cmd(["ip", "netns", "list"]).splitlines() if line.strip()
    ]
    removed = []
    # veths first (synchronous removal of both ends), then namespaces, then bridges.
    for name in [n for n in links if stale(n) == "v"]:
        delete_link(name)
        removed.append(name)
    for name in [n for n in namespaces if stale(n) in ("n", "r")]:
        delete_namespace(name)
        removed.append(name)
    for name in [n for n in links if stale(n) == "b"]:
        delete_link(name)
        removed.append(name)
    return removed
