"""Finding the text files of a corpus and assigning each, by a hash of its path, to train or val.

Which files count as text:
  * default corpus (no paths): every `*.py` file under `sysconfig.get_paths()["stdlib"]`, except
    under `site-packages`/`dist-packages` (installed packages differ between machines; the stdlib
    of one Python version does not);
  * a path naming a file: that file, whatever its suffix;
  * a path naming a folder: every regular file below it, recursively, except hidden entries
    (name starting with ".", e.g. `.git`) and `__pycache__` folders.
  Empty files are skipped; files containing a NUL byte are treated as binary when read (skipped
  inside folders, an error when named directly), see `swarm.data.corpus`.

Each file has a `key`, its path relative to the root it was found under (posix form; for a file
named directly, its base name). The split depends only on the key, never on walk order or on the
machine, so every trainer and peer sees the same validation files.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import UsageError

_SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})


class CorpusError(UsageError):
    """A corpus path is missing, holds no usable text, or the text is too short for the request (a
    ``ValueError`` too)."""


@dataclass(frozen=True)
class SourceFile:
    path: Path  # where to read it
    key: str  # relative posix path that decides its split
    explicit: bool  # named directly by the user (binary content is then an error, not a skip)


def default_corpus_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def find_source_files(paths: Sequence[str]) -> list[SourceFile]:
    """Candidate files for `paths` (or the stdlib `.py` files if empty), sorted by key, deduplicated.

    Raises CorpusError if a path does not exist, is neither a file nor a folder, names an empty
    file, or is a folder without a single non-empty candidate file.
    """
    found: list[SourceFile] = []
    if not paths:
        root = default_corpus_root()
        found = list(_walk(root, suffix=".py"))
        if not found:
            raise CorpusError(
                f"no .py files found under the standard library folder {root}; pass --data PATH"
            )
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            if path.stat().st_size == 0:
                raise CorpusError(f"data file {raw} is empty")
            found.append(SourceFile(path=path, key=path.name, explicit=True))
        elif path.is_dir():
            files = list(_walk(path, suffix=None))
            if not files:
                raise CorpusError(f"data folder {raw} contains no non-empty, non-hidden files")
            found.extend(files)
        elif path.exists():
            raise CorpusError(f"data path {raw} is neither a regular file nor a folder")
        else:
            raise CorpusError(f"data path {raw} does not exist")
    unique: dict[Path, SourceFile] = {}
    for source in found:
        unique.setdefault(source.path.resolve(), source)  # the same file named twice is read once
    return sorted(unique.values(), key=lambda s: (s.key, str(s.path)))


def _walk(root: Path, *, suffix: str | None):
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk does not descend; sort for a reproducible read order.
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and d not in _SKIPPED_DIRS
        )
        for name in sorted(filenames):
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            path = Path(dirpath, name)
            try:
                if not path.is_file() or path.stat().st_size == 0:
                    continue
            except OSError:  # a dangling symlink or a file removed while walking
                continue
            yield SourceFile(path=path, key=path.relative_to(root).as_posix(), explicit=False)


def split_hash(key: str) -> float:
    """Uniform number in [0, 1) derived from `key` alone (sha256, stable across machines)."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_files(
    files: Sequence[SourceFile], val_fraction: float
) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, val): a file is validation iff split_hash(key) < val_fraction.

    With two or more files both lists are non-empty: if no file hashed into validation, the one
    with the smallest hash is moved there; if every file did, the one with the largest hash is
    moved to train. Order within each list follows `files`.
    """
    hashes = [split_hash(f.key) for f in files]
    is_val = [h < val_fraction for h in hashes]
    if len(files) >= 2:
        if not any(is_val):
            is_val[min(range(len(files)), key=hashes.__getitem__)] = True
        elif all(is_val):
            is_val[max(range(len(files)), key=hashes.__getitem__)] = False
    train = [f for f, v in zip(files, is_val, strict=True) if not v]
    val = [f for f, v in zip(files, is_val, strict=True) if v]
    return train, val
