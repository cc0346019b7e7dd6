"""Files that survive a crash: written to a unique temporary name beside the target, flushed and fsynced,
then renamed over it, and the directory fsynced so the rename itself is on disk.

A reader therefore sees either the previous file or the new one, never a torn write, even after a power
loss; two writers of the same path (a periodic checkpoint racing a drain's) never share a temporary file.
Loading is the other half: :func:`load_tensors` uses ``torch.load(weights_only=True)``, so a file planted
by someone else cannot run code when it is read.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_tensors", "save_atomic"]


def save_atomic(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` atomically and durably (see the module). ``obj`` must hold only what
    ``weights_only=True`` loads back: tensors, numbers, strings, and lists, tuples and dicts of them. On any
    failure the previous file is untouched and no temporary file is left."""
    path = Path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)
    return path


def load_tensors(path: str | os.PathLike) -> Any:
    """``torch.load`` with ``weights_only=True`` onto the CPU. Raises ValueError naming the file when it holds
    anything else (a pickled object that would run code) or is not a torch file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise ValueError(
            f"cannot read {path} as tensors and plain values ({type(e).__name__}); it holds other objects "
            f"(refused: loading them could run code), was not written by swarm, or is damaged"
        ) from None


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
