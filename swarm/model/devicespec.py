"""The names ``--device`` and ``--dtype`` take, checked without importing torch (config checks run before it)."""

from __future__ import annotations

import re

DTYPE_NAMES = ("fp32", "bf16", "fp16")
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def check_device_spec(spec: str) -> None:
    """Raise ValueError unless ``spec`` is auto, cpu, mps, cuda or cuda:N."""
    if not _DEVICE_RE.match(spec):
        raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {spec!r}")


def check_dtype_name(name: str) -> None:
    """Raise ValueError unless ``name`` is one of :data:`DTYPE_NAMES`."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
