"""A Docker engine for the compose demo on a machine that may have none: install it, start it, stop it.

:func:`why_unavailable` says why this machine cannot have an engine here (not Linux, not root, no apt-get, no
package registry); :class:`DockerEngine` installs what is missing from Debian's packages (``docker.io``, Compose
v1 ``docker-compose``, ``debootstrap`` for a local base image), uses a daemon that already answers, or starts one
and on the way out stops it and puts the host's firewall back as it found it.

Why the firewall needs care: dockerd adds iptables rules and, when it has to turn IPv4 forwarding on itself, sets
the FORWARD policy to DROP. Where bridge netfilter is on (``bridge-nf-call-iptables = 1``), that policy also
applies to frames crossing any Linux bridge, and the network-namespace harness (``deploy/netns``) runs its hosts
on one: it would be cut off while the daemon runs, and after it. So forwarding is turned on before dockerd starts
(dockerd then leaves the policy alone; its own rules name only its own bridges), and afterwards the iptables
tables, the forwarding switch and the links dockerd made are restored to what they were before it started.

A daemon killed without that cleanup (its machine's session ended, say) leaves its rules and bridges behind, and
the next daemon does not take them over: it names a network's bridge anew, so a stale ``MASQUERADE`` of the
network's subnet "not out of the old bridge" then rewrites the source of every packet between the new network's
containers (the compose demo's peers each found their own address unreachable, and served through relays). So
before starting a daemon, :func:`clear_leftovers` removes what a dead one left.

Needs root. Used by ``python -m deploy.compose`` and tests/test_compose_live.py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy.apt import AptError, apt_install

# command -> the Debian package that provides it (compose: unless `docker compose`, v2, answers)
PACKAGES = {
    "dockerd": "docker.io",
    "docker-compose": "docker-compose",
    "debootstrap": "debootstrap",
}
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
# the built-in chains of each iptables table, for restoring a table that did not exist before
BUILTIN_CHAINS = {
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    "raw": ("PREROUTING", "OUTPUT"),
    "security": ("INPUT", "FORWARD", "OUTPUT"),
}
# links dockerd makes: its default bridge, a compose network's bridge, the host side of a container's veth
DOCKER_LINK_PREFIXES = ("docker", "br-", "veth")
# the bridges among them: the default one, and a user network's ("br-" and 12 hex digits of its id)
DOCKER_BRIDGE = re.compile(r"^(docker0|br-[0-9a-f]{12})$")


class EngineError(RuntimeError):
    """The engine could not be installed, started or stopped; the message says what happened and what to do."""


def why_unavailable(*, offline: bool = True) -> str | None:
    """Why this machine cannot install and start a Docker engine for this process (None when it can). Asks the
    package registry (``apt-get update``) only when a package is missing."""
    if sys.platform != "linux":
        return "needs Linux"
    if os.geteuid() != 0:
        return "needs root, to install and start a Docker engine"
    if not (missing := missing_packages(offline=offline)):
        return None
    if shutil.which("apt-get") is None:
        return f"{', '.join(missing)} missing and no apt-get to install them"
    update = subprocess.run(["apt-get", "update"], capture_output=True, text=True, timeout=300)
    if update.returncode != 0:
        last = (update.stderr or update.stdout).strip().splitlines()[-1:]
        return f"no package registry reachable (apt-get update failed: {' '.join(last)})"
    return None


def compose_command() -> list[str] | None:
    """``docker compose`` (v2) if the Docker CLI has it, else ``docker-compose`` (v1), else None."""
    if shutil.which("docker") is not None:
        v2 = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if v2.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") is not None else None


def missing_packages(*, offline: bool) -> list[str]:
    """The Debian packages to install: the engine, Compose (v1) where no Compose answers, and debootstrap for a
    base image built here (``offline``), each unless its command is on PATH."""
    wanted = ["dockerd", "debootstrap"] if offline else ["dockerd"]
    missing = {PACKAGES[cmd] for cmd in wanted if shutil.which(cmd) is None}
    if compose_command() is None:
        missing.add(PACKAGES["docker-compose"])
    return sorted(missing)


def install_packages(log, *, offline: bool) -> None:
    """``apt-get install`` what is missing (see :func:`deploy.apt.apt_install`)."""
    try:
        apt_install(missing_packages(offline=offline), log)
    except AptError as e:
        raise EngineError(str(e)) from None


def docker_answers() -> bool:
    """Whether a Docker daemon answers on the default socket."""
    if shutil.which("docker") is None:
        return False
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


@dataclass(frozen=True)
class HostNetwork:
    """What dockerd changes on the host, as it was at :meth:`capture`. Two captures are equal when the firewall
    acts the same (``rules``), forwarding is the same and the same Docker links exist."""

    # iptables command -> its `-save` output ("" when it has no tables or is absent), for iptables-restore
    saved: dict[str, str] = field(compare=False)
    rules: tuple[str, ...]  # what acts on traffic (see _effective_rules)
    ip_forward: str
    docker_links: frozenset[str]  # links named like dockerd's (others come and go with other work)

    @classmethod
    def capture(cls) -> HostNetwork:
        saved = {}
        for command in ("iptables", "ip6tables"):
            if shutil.which(f"{command}-save") is not None:
                done = subprocess.run(
                    [f"{command}-save"], capture_output=True, text=True, check=True
                )
                saved[command] = done.stdout
        return cls(
            saved=saved,
            rules=tuple(
                f"{command} {rule}"
                for command, text in sorted(saved.items())
                for rule in _effective_rules(text)
            ),
            ip_forward=IP_FORWARD.read_text().strip(),
            docker_links=_docker_links(),
        )

    def restore(self) -> None:
        """Put the tables, the forwarding switch and the links back as captured: a table created since is
        emptied (policies ACCEPT), one that existed gets its rules back, Docker links made since are deleted."""
        for command in ("iptables", "ip6tables"):
            if shutil.which(f"{command}-restore") is None:
                continue
            before = self.saved.get(command, "")
            now = subprocess.run([f"{command}-save"], capture_output=True, text=True, check=True)
            # iptables-restore replaces each table it is given whole (rules and user chains).
            empty = "".join(
                f"*{table}\n"
                + "".join(f":{chain} ACCEPT [0:0]\n" for chain in BUILTIN_CHAINS[table])
                + "COMMIT\n"
                for table in sorted(_tables(now.stdout) - _tables(before))
                if table in BUILTIN_CHAINS
            )
            subprocess.run([f"{command}-restore"], input=before + empty, text=True, check=True)
        IP_FORWARD.write_text(self.ip_forward + "\n")
        for link in sorted(_docker_links() - self.docker_links):
            subprocess.run(["ip", "link", "delete", link], capture_output=True)


def _tables(saved: str) -> set[str]:
    return {line[1:].strip() for line in saved.splitlines() if line.startswith("*")}


def _effective_rules(saved: str) -> list[str]:
    """The lines of an ``iptables-save`` output that act on traffic, each prefixed with its table: rules, user
    chains, and built-in chains whose policy is not ACCEPT. (Comments, counters and empty tables do not: a table
    emptied back to ACCEPT acts as no table.)"""
    out, table = [], ""
    for line in saved.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif line.startswith("-A "):
            out.append(f"{table} {line}")
        elif line.startswith(":"):
            chain, policy = line[1:].split()[:2]
            if chain not in BUILTIN_CHAINS.get(table, ()) or policy != "ACCEPT":
                out.append(f"{table} :{chain} {policy}")
    return out


def _docker_links() -> frozenset[str]:
    return frozenset(
        name for name in os.listdir("/sys/class/net") if name.startswith(DOCKER_LINK_PREFIXES)
    )


def clear_leftovers() -> list[str]:
    """Remove what Docker daemons that no longer run left on the host (see the module docstring): their iptables
    chains (``DOCKER...``), the rules that jump to them or name one of their bridges, and their bridges with the
    veths on them. Call only when no daemon runs: a live one's rules look the same. Returns what it removed, the
    rules as :attr:`HostNetwork.rules` writes them, the links as ``link <name>``."""
    removed = []
    for command in ("iptables", "ip6tables"):
        if shutil.which(f"{command}-save") is None or shutil.which(f"{command}-restore") is None:
            continue
        saved = subprocess.run([f"{command}-save"], capture_output=True, text=True, check=True)
        kept, table = [], ""
        for line in saved.stdout.splitlines(keepends=True):
            if line.startswith("*"):
                table = line[1:].strip()
            if _is_dockers(line):
                if line.startswith(("-A ", ":")):
                    removed.append(f"{command} {table} {line.rstrip()}")
                continue
            kept.append(line)
        if len(kept) < len(saved.stdout.splitlines()):
            subprocess.run([f"{command}-restore"], input="".join(kept), text=True, check=True)
    links = os.listdir("/sys/class/net")
    bridges = [name for name in links if DOCKER_BRIDGE.match(name)]
    on_them = [
        name
        for name in links
        if name.startswith("veth")
        and os.path.basename(os.path.realpath(f"/sys/class/net/{name}/master")) in bridges
    ]
    for name in on_them + bridges:
        done = subprocess.run(["ip", "link", "delete", name], capture_output=True)
        if done.returncode == 0:
            removed.append(f"link {name}")
    return removed


def _is_dockers(line: str) -> bool:
    """Whether a line of ``iptables-save`` output is one of Docker's chains or rules."""
    if line.startswith(":"):
        return line[1:].startswith("DOCKER")
    if not line.startswith("-A "):
        return False
    words = line.split()
    if words[1].startswith("DOCKER"):
        return True
    return any(
        (flag in ("-j", "-g") and value.startswith("DOCKER"))
        or (flag in ("-i", "-o") and DOCKER_BRIDGE.match(value))
        for flag, value in zip(words, words[1:])
    )


class DockerEngine:
    """A Docker daemon for the duration of a ``with`` block: the one that answers already, or one started here
    (``dockerd``, its log in ``workdir``), stopped on exit with the host's network put back (module docstring).
    ``install=True`` installs missing packages first (``offline``: debootstrap too). Raises :class:`EngineError`
    if the daemon does not answer within ``start_timeout_s``."""

    def __init__(
        self,
        workdir: Path,
        *,
        install: bool = True,
        offline: bool = True,
        start_timeout_s: float = 60.0,
    ):
        self.workdir = Path(workdir)
        self.install = install
        self.offline = offline  # install debootstrap too, for deploy/baseimage.py
        self.start_timeout_s = start_timeout_s
        self.started: subprocess.Popen | None = None  # the daemon this object started, if any
        self._network: HostNetwork | None = None
        self.install_s = 0.0  # seconds spent installing packages
        self.start_s = 0.0  # seconds until the daemon answered
        self.cleared: list[str] = []  # what dead daemons had left, removed before this one started

    def __enter__(self) -> DockerEngine:
        self.workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        if self.install:
            with open(self.workdir / "apt.log", "w") as log:
                install_packages(log, offline=self.offline)
        self.install_s = time.monotonic() - t0
        if docker_answers():
            return self
        if os.geteuid() != 0:
            raise EngineError(
                "no Docker daemon answers, and only root may start one: start Docker first"
            )
        t0 = time.monotonic()
        if subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True).returncode == 1:
            self.cleared = (
                clear_leftovers()
            )  # (a dockerd that runs but does not answer keeps its own)
        self._network = HostNetwork.capture()
        try:
            # Forwarding on before dockerd starts, so that it leaves the FORWARD policy alone.
            IP_FORWARD.write_text("1\n")
            log_path = self.workdir / "dockerd.log"
            with open(log_path, "w") as log:
                self.started = subprocess.Popen(
                    ["dockerd", "--pidfile", str(self.workdir / "dockerd.pid")],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a Ctrl-C of the caller reaches it through __exit__ only
                )
            deadline = time.monotonic() + self.start_timeout_s
            while not docker_answers():
                if self.started.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text().splitlines()[-5:]
                    raise EngineError(
                        f"dockerd did not answer within {self.start_timeout_s:.0f}s "
                        f"(exit code {self.started.poll()}); last lines of {log_path}:\n"
                        + "\n".join(tail)
                    )
                time.sleep(0.2)
        except BaseException:
            self._stop()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self, timeout_s: float = 60.0) -> None:
        """Stop the daemon started here (SIGTERM; it stops its containers and its containerd), then restore the
        host's network. Nothing to do for a daemon that was already running."""
        if self.started is not None:
            if self.started.poll() is None:
                self.started.send_signal(signal.SIGTERM)
                try:
                    self.started.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(self.started.pid, signal.SIGKILL)
                    self.started.wait(10)
            self.started = None
        if self._network is not None:
            self._network.restore()
            self._network = None
