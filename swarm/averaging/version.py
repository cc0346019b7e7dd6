"""The one hivemind version swarm's averaging runs on, checked without importing hivemind when it is not
imported yet (the package does so on import; see swarm.averaging)."""

from __future__ import annotations

import importlib.metadata
import sys

from swarm.errors import SwarmError

PINNED_HIVEMIND = "1.1.12"


class UnsupportedHivemind(SwarmError):
    """The installed hivemind is not the version whose private API swarm's averaging was written against."""


def installed_hivemind() -> str:
    """The version of the hivemind imported in this process, or else of the one installed."""
    module = sys.modules.get("hivemind")
    if module is not None:
        return getattr(module, "__version__", "unknown")
    try:
        return importlib.metadata.version("hivemind")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def check_hivemind_version() -> None:
    """Raise :class:`UnsupportedHivemind` unless the hivemind in use is :data:`PINNED_HIVEMIND`."""
    installed = installed_hivemind()
    if installed != PINNED_HIVEMIND:
        raise UnsupportedHivemind(
            f"swarm's gradient averaging needs hivemind {PINNED_HIVEMIND} (it uses private parts of it that other "
            f"versions change), but hivemind {installed} is installed; run: pip install hivemind=={PINNED_HIVEMIND}"
        )
