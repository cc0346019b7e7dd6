"""The corpus: two flat token tensors (train, val; uint8 bytes or int32 token ids) and cheap window sampling."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from swarm.data.config import DataConfig
from swarm.data.files import CorpusError, SourceFile, find_source_files, split_files

SPLITS = ("train", "val")


class ByteCorpus:
    """Text of many files (or documents) concatenated per split: one token per byte (ids 0..255, uint8), or
    the ids a tokenizer gave (int32).

    Windows may span the boundary between two files; at this scale that is harmless and it keeps
    sampling a single gather.
    """

    def __init__(
        self,
        train: Tensor,
        val: Tensor,
        *,
        train_files: int,
        val_files: int,
        split_by_file: bool = True,
    ):
        for name, data in (("train", train), ("val", val)):
            if data.dtype not in (torch.uint8, torch.int32) or data.dim() != 1 or data.numel() == 0:
                raise ValueError(
                    f"{name} split must be a non-empty 1-D uint8 (bytes) or int32 (token ids) tensor, got "
                    f"{data.dtype} {tuple(data.shape)}"
                )
        self._data = {"train": train, "val": val}
        self.train_files = train_files  # files contributing to each split
        self.val_files = val_files
        self.split_by_file = split_by_file  # False when one file had to be cut in two (see `load`)

    @property
    def train_bytes(self) -> int:
        return self._data["train"].numel()

    @property
    def val_bytes(self) -> int:
        return self._data["val"].numel()

    @classmethod
    def from_bytes(cls, train: bytes, val: bytes) -> ByteCorpus:
        """A corpus from in-memory text (tests, demos)."""
        return cls(
            _to_tensor(bytearray(train)), _to_tensor(bytearray(val)), train_files=1, val_files=1
        )

    @classmethod
    def load(cls, config: DataConfig) -> ByteCorpus:
        """Read the files of `config` once (see `swarm.data.files` for which files are text).

        Files go to train or val by a hash of their relative path. With `max_bytes`, validation
        gets ceil(max_bytes * val_fraction) of it and train the rest, each filled from its files in
        path order (the last file read is truncated). If the by-file split leaves a split empty
        (one usable file, or every validation file was binary), the text is cut instead: its last
        ceil(n * val_fraction) bytes become validation and `split_by_file` is False.
        Raises CorpusError (a ValueError) if a path is missing, a named file is binary, or no text is left.
        """
        files = find_source_files(config.paths)
        train_files, val_files = split_files(files, config.val_fraction)
        train_cap = val_cap = None
        if config.max_bytes is not None:
            val_cap = max(1, math.ceil(config.max_bytes * config.val_fraction))
            train_cap = max(1, config.max_bytes - val_cap)
        train, n_train = _read_files(train_files, train_cap)
        val, n_val = _read_files(val_files, val_cap)
        if train and val:
            return cls(_to_tensor(train), _to_tensor(val), train_files=n_train, val_files=n_val)
        text = train or val
        if len(text) < 2:
            where = ", ".join(config.paths) if config.paths else "the standard library"
            raise CorpusError(
                f"no usable text found in {where} (need at least 2 bytes of non-binary files)"
            )
        cut = min(max(1, math.ceil(len(text) * config.val_fraction)), len(text) - 1)
        train_part, val_part = _to_tensor(text[:-cut]), _to_tensor(text[-cut:])
        return cls(
            train_part, val_part, train_files=n_train + n_val, val_files=1, split_by_file=False
        )

    def shard(self, index: int, count: int) -> ByteCorpus:
        """The corpus whose training split is part ``index`` of ``count`` equal, contiguous parts of this one's
        (views, no copy); validation stays whole, the same for every shard. CorpusError when a part is empty."""
        train = self._data["train"]
        lo, hi = index * train.numel() // count, (index + 1) * train.numel() // count
        if hi <= lo:
            raise CorpusError(
                f"shard {index}/{count} of {train.numel()} training {self._unit()} is empty; use fewer shards"
            )
        return ByteCorpus(
            train[lo:hi],
            self._data["val"],
            train_files=self.train_files,
            val_files=self.val_files,
            split_by_file=self.split_by_file,
        )

    def split(self, name: str) -> Tensor:
        """The raw uint8 (N,) tensor of split `name` ("train" or "val"); do not modify it."""
        if name not in self._data:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return self._data[name]

    def sample(
        self, split: str, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> Tensor:
        """int64 (batch_size, seq_len + 1) windows at uniformly random offsets drawn from `generator`.

        inputs = batch[:, :-1], targets = batch[:, 1:]. Same generator state -> same batch.
        """
        data = self.split(split)
        window = self._check_window(split, batch_size, seq_len)
        # (B,)
        starts = torch.randint(0, data.numel() - window + 1, (batch_size,), generator=generator)
        return data[starts[:, None] + torch.arange(window)].long()  # (B, T + 1)

    def val_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[Tensor]:
        """`num_batches` int64 (batch_size, seq_len + 1) batches of evenly spaced validation windows.

        The first window starts at byte 0 and the last ends at the end of the split; no randomness,
        so every machine and run evaluates on the same text. Windows overlap if the split is short.
        """
        if num_batches < 1:
            raise ValueError(f"num_batches must be >= 1, got {num_batches}")
        data = self.split("val")
        window = self._check_window("val", batch_size, seq_len)
        count = batch_size * num_batches
        last_start = data.numel() - window
        # (B * N,)
        starts = torch.arange(count, dtype=torch.int64) * last_start // max(count - 1, 1)
        windows = data[starts[:, None] + torch.arange(window)].long()  # (B * N, T + 1)
        return list(windows.split(batch_size))

    def describe(self) -> str:
        """One line for logs, e.g. '33.9 MB train (1755 files), 0.6 MB val (35 files)'."""
        how = "" if self.split_by_file else " (one file cut in two)"
        unit = "MB" if self._unit() == "bytes" else "M tokens"
        return (
            f"{self.train_bytes / 1e6:.1f} {unit} train ({self.train_files} files), "
            f"{self.val_bytes / 1e6:.1f} {unit} val ({self.val_files} files){how}"
        )

    def _unit(self) -> str:
        return "bytes" if self._data["train"].dtype == torch.uint8 else "tokens"

    def _check_window(self, split: str, batch_size: int, seq_len: int) -> int:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        window = seq_len + 1
        if self._data[split].numel() < window:
            raise CorpusError(
                f"the {split} split has {self._data[split].numel()} {self._unit()}, fewer than one window of "
                f"seq_len + 1 = {window}; add text or raise max_bytes"
            )
        return window


def _read_files(files: Sequence[SourceFile], cap: int | None) -> tuple[bytearray, int]:
    """Concatenate the text of `files` (at most `cap` bytes); returns (text, files used)."""
    buf = bytearray()
    used = 0
    for source in files:
        remaining = -1 if cap is None else cap - len(buf)
        if remaining == 0:
            break
        try:
            with open(source.path, "rb") as fh:
                data = fh.read(remaining)
        except OSError as exc:
            if source.explicit:
                raise CorpusError(f"cannot read data file {source.path}: {exc}") from exc
            continue  # unreadable file inside a folder: skip it like a binary one
        if b"\0" in data:
            if source.explicit:
                raise CorpusError(
                    f"data file {source.path} looks binary (contains NUL bytes); pass text files"
                )
            continue
        buf += data
        used += 1
    return buf, used


def _to_tensor(buf: bytearray) -> Tensor:
    # frombuffer shares memory with (and keeps alive) the bytearray: no copy of a ~30 MB corpus.
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
