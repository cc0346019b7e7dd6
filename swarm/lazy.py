"""Package exports imported on first use (PEP 562), so that importing a package for its torch-free parts
(configs, names) does not import torch or hivemind. ``swarm --help`` and config parsing stay instant."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the package whose globals are ``namespace``: ``exports`` maps each name
    to the module that defines it, imported when the name is first read (then kept in ``namespace``)."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
