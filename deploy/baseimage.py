"""A base image for deploy/Dockerfile built from Debian's packages, for a machine that cannot pull from Docker Hub.

``debootstrap --variant=minbase`` lays out Debian bookworm with python3, its venv module, CA certificates and
``useradd`` (all the Dockerfile needs of a base: it makes its own virtual environment), and ``docker import``
turns the folder into an image. Its Python is 3.11, as in ``python:3.11-slim``, so the same wheels fit.

Cached twice, so a second run costs nothing: the image stays in the engine's store under its tag, and the
downloaded packages stay in ``CACHE_DIR`` for when the store was emptied. Needs root and a Debian mirror.

    sudo python3 -m deploy.baseimage            # builds swarm-base:bookworm unless the engine has it
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

TAG = "swarm-base:bookworm"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd")
CACHE_DIR = Path("/var/cache/swarm/debootstrap")


def image_exists(tag: str) -> bool:
    done = subprocess.run(["docker", "image", "inspect", tag], capture_output=True)
    return done.returncode == 0


def ensure_base_image(tag: str = TAG, *, log, mirror: str = MIRROR) -> bool:
    """Build and import the image ``tag`` unless the engine has it; True if it was built now. Raises
    CalledProcessError (its output in ``log``) when debootstrap or the import fails."""
    if image_exists(tag):
        return False
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swarm-base-") as tmp:
        root = Path(tmp) / "root"
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                f"--cache-dir={CACHE_DIR}",
                SUITE,
                str(root),
                mirror,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
        # Package lists and downloaded archives are of no use in the image (it installs nothing with apt).
        for junk in ("var/lib/apt/lists", "var/cache/apt/archives"):
            shutil.rmtree(root / junk, ignore_errors=True)
        tar = subprocess.Popen(
            ["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE
        )
        try:
            subprocess.run(
                ["docker", "import", "--change", 'CMD ["python3"]', "-", tag],
                stdin=tar.stdout,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
            )
        finally:
            tar.stdout.close()
            tar.wait()
    return True


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.baseimage", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tag", default=TAG, help=f"image name (default {TAG})")
    parser.add_argument("--mirror", default=MIRROR, help=f"Debian mirror (default {MIRROR})")
    args = parser.parse_args()
    import sys

    built = ensure_base_image(args.tag, log=sys.stdout, mirror=args.mirror)
    print(f"{args.tag}: {'built' if built else 'already in the engine'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
