"""Configuration of the byte-level corpus."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where the training text comes from and how it is split.

    With no `paths`, the corpus is the `.py` files of the running interpreter's standard library.
    """

    FLAG_TITLE = "data"

    # Files or folders of text (folders are walked recursively); empty = the Python stdlib sources.
    paths: tuple[str, ...] = field(default=(), metadata={"flag": "--data"})
    # Approximate share of FILES (not bytes) held out for validation, chosen by a hash of each path.
    val_fraction: float = 0.02
    # Cap on the bytes loaded (split between train and val as val_fraction says); None = load all.
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.paths, (str, os.PathLike)):
            raise ValueError(
                f"DataConfig.paths must be a sequence of paths, got the single path {self.paths!r}"
            )
        # accept lists and Path objects from callers
        paths = tuple(os.fspath(p) for p in self.paths)
        object.__setattr__(self, "paths", paths)
        if any(p == "" for p in paths):
            raise ValueError("DataConfig.paths contains an empty path")
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float)):
            raise ValueError(f"DataConfig.val_fraction must be a number, got {self.val_fraction!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"DataConfig.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.max_bytes is not None:
            if (
                isinstance(self.max_bytes, bool)
                or not isinstance(self.max_bytes, int)
                or self.max_bytes < 2
            ):
                raise ValueError(
                    f"DataConfig.max_bytes must be None or an int >= 2 (one byte per split), got {self.max_bytes!r}"
                )
