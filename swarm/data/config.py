"""Configuration of the training data: files, their format, the tokenizer, where the trainer's position is kept."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DATA_FORMATS = ("auto", "files", "text", "json", "parquet")


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where the training text comes from and how it is split.

    With no `paths`, the corpus is the `.py` files of the running interpreter's standard library.
    """

    FLAG_TITLE = "data"

    # Files or folders of text (folders are walked recursively), or of a dataset (.jsonl, .parquet, see
    # --data-format); empty = the Python stdlib sources.
    paths: tuple[str, ...] = field(default=(), metadata={"flag": "--data"})
    # Approximate share of FILES (not bytes; of documents for datasets) held out for validation, chosen by a hash
    # of each path (of each document's text).
    val_fraction: float = 0.02
    # Cap on the bytes loaded (split between train and val as val_fraction says); None = load all.
    max_bytes: int | None = None
    # how to read --data: files (walked, read whole), or through Hugging Face datasets as text (one example per
    # line), json (JSON lines, see --text-field) or parquet; auto = json/parquet by the files' suffixes, else files
    data_format: str = field(default="auto", metadata={"choices": DATA_FORMATS})
    text_field: str = "text"  # the column holding the text, for json and parquet data
    # read the dataset as a stream (for data larger than memory; json/text/parquet only): each trainer shuffles
    # it with its own seed in a buffer and reads it once in that order
    streaming: bool = False
    # a local tokenizer directory (holding tokenizer.json; never downloaded); unset = one token per byte
    tokenizer: str | None = None
    # "K/N": this trainer reads only part K (0-based) of N equal, disjoint parts of the training data (give each of
    # N trainers its own K); unset = all of it (trainers then differ by their seeds alone)
    shard: str | None = None
    # where the trainer keeps its data position (read at start to resume, written after each step); unset =
    # next to --identity-path (PATH.data.json) when that is given, else not kept
    data_state: str | None = None

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
        if self.data_format not in DATA_FORMATS:
            raise ValueError(
                f"DataConfig.data_format must be one of {', '.join(DATA_FORMATS)}, got {self.data_format!r}"
            )
        if not self.text_field:
            raise ValueError("DataConfig.text_field must name a column, got an empty string")
        if self.streaming and self.resolved_format() == "files":
            raise ValueError(
                "--streaming reads through Hugging Face datasets: give --data-format text, json or parquet "
                "(or .jsonl/.parquet files)"
            )
        self.shard_part()  # raises on a malformed --shard
        if self.max_bytes is not None:
            if (
                isinstance(self.max_bytes, bool)
                or not isinstance(self.max_bytes, int)
                or self.max_bytes < 2
            ):
                raise ValueError(
                    f"DataConfig.max_bytes must be None or an int >= 2 (one byte per split), got {self.max_bytes!r}"
                )

    def resolved_format(self) -> str:
        """The format ``auto`` stands for: json when every path ends in .json/.jsonl, parquet when every one
        ends in .parquet, else files."""
        if self.data_format != "auto":
            return self.data_format
        suffixes = {os.path.splitext(p)[1].lower() for p in self.paths}
        if suffixes and suffixes <= {".json", ".jsonl"}:
            return "json"
        if suffixes == {".parquet"}:
            return "parquet"
        return "files"

    def shard_part(self) -> tuple[int, int]:
        """(K, N) of ``shard``; (0, 1) when unset. ValueError unless it reads "K/N" with 0 <= K < N."""
        if self.shard is None:
            return 0, 1
        k, sep, n = str(self.shard).partition("/")
        if not (sep and k.strip().isdigit() and n.strip().isdigit()) or not 0 <= int(k) < int(n):
            raise ValueError(
                f"--shard must read K/N with 0 <= K < N (e.g. 0/4 for the first of 4 trainers), got {self.shard!r}"
            )
        return int(k), int(n)
