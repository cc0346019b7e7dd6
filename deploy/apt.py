"""Debian packages the harnesses need (the Docker engine for the compose demo, nftables for emulated NAT routers),
installed with ``apt-get`` as root where they are missing, from the package registry."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


class AptError(RuntimeError):
    """An ``apt-get`` step failed; the message names the log that says why."""


def apt_install(packages: list[str], log) -> None:
    """``apt-get install`` ``packages`` (after ``apt-get update``), without starting any service: where the machine
    has no ``policy-rc.d`` that forbids it, one is put in place for the install and removed after. ``log``: an open
    file for apt's output."""
    if not packages:
        return
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text(
            "#!/bin/sh\n# deploy/apt.py: no service starts during its install\nexit 101\n"
        )
        policy.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (
            ["apt-get", "update"],
            ["apt-get", "install", "-y", "--no-install-recommends", *packages],
        ):
            done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=600)
            if done.returncode != 0:
                raise AptError(
                    f"`{' '.join(argv)}` failed (exit {done.returncode}); see {log.name}"
                )
    finally:
        if made_policy:
            policy.unlink()
