"""What one trainer reads: its own sequence of training windows, seeded by the trainer, resumable.

Two feeds share one interface (``next_batch``, ``val_batches``, ``state_dict``/``load_state_dict``):

* :class:`RandomWindows`: windows at random offsets of an in-memory corpus, drawn from a generator seeded with
  the trainer's seed. Trainers with different seeds draw different windows; its state is the generator's.
* :class:`StreamWindows`: a streamed dataset, shuffled in a buffer with the trainer's seed and read once per
  epoch in that order, skipping validation documents; its state is the dataset's position (``datasets``'
  ``IterableDataset.state_dict``) and the tokens read but not yet used.

A feed's seed defaults to one derived from the trainer's identity (:func:`seed_of`), so two trainers started
with the same flags never feed the same batches; ``--seed`` fixes it. :class:`FeedState` keeps a feed's state in
a JSON file (written atomically after each step), so a restarted trainer continues where it stopped.

With ``--shard K/N`` a trainer reads only its part of the training data (a contiguous Nth of the tokens, or
an Nth of a stream's examples), disjoint from the other N-1 trainers'.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from swarm.data.config import DataConfig
from swarm.data.corpus import ByteCorpus
from swarm.data.files import CorpusError, split_hash
from swarm.data.tokenizer import ByteTokenizer, Tokenizer

logger = logging.getLogger(__name__)

STATE_FORMAT = 1


def seed_of(trainer_id: str) -> int:
    """A 63-bit sampling seed derived from a trainer's id (stable for a kept identity)."""
    return int.from_bytes(hashlib.sha256(f"data {trainer_id}".encode()).digest()[:8], "big") >> 1


class RandomWindows:
    """Random windows of an in-memory corpus; ``microbatches`` counts the batches drawn."""

    kind = "random"

    def __init__(self, corpus: ByteCorpus, seed: int):
        self.corpus = corpus
        self.seed = seed
        self.microbatches = 0
        self._generator = torch.Generator().manual_seed(seed)

    def next_batch(self, batch_size: int, seq_len: int) -> Tensor:
        """int64 (batch_size, seq_len + 1) training windows."""
        batch = self.corpus.sample("train", batch_size, seq_len, self._generator)
        self.microbatches += 1
        return batch

    def val_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[Tensor]:
        return self.corpus.val_batches(batch_size, seq_len, num_batches)

    def describe(self) -> str:
        return self.corpus.describe()

    def state_dict(self) -> dict:
        state = self._generator.get_state().numpy().tobytes()
        return {"microbatches": self.microbatches, "generator": base64.b64encode(state).decode()}

    def load_state_dict(self, state: dict) -> None:
        raw = base64.b64decode(state["generator"])
        self._generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        self.microbatches = int(state["microbatches"])


class StreamWindows:
    """Consecutive windows of a streamed dataset in the trainer's shuffled order (see the module docstring).

    Windows do not overlap: each token is trained on once per epoch (the last token of a window is also the
    first input of the next). An epoch ends when the stream does; the next reshuffles (``set_epoch``).
    """

    kind = "stream"

    def __init__(
        self, config: DataConfig, tokenizer: Tokenizer, seed: int, *, buffer_size: int = 1000
    ):
        from swarm.data.hfdata import load_dataset, text_field

        self.config = config
        self.seed = seed
        self.microbatches = 0
        self._tokenizer = tokenizer
        self._field = text_field(config)
        self._source = load_dataset(config, streaming=True)
        index, count = config.shard_part()
        train = self._source
        if count > 1:
            from datasets.distributed import split_dataset_by_node

            train = split_dataset_by_node(train, rank=index, world_size=count)
        self._train = train.shuffle(seed=seed % 2**32, buffer_size=buffer_size)
        self._epoch = 0
        self._iterator = None
        self._buffer: list[int] = []
        self._val: Tensor | None = None

    def _documents(self, dataset):
        for example in dataset:
            text = example.get(self._field)
            if isinstance(text, str) and text:
                yield text

    def _next_train_text(self) -> str:
        for _ in range(2):  # at most one epoch boundary per document
            if self._iterator is None:
                self._train.set_epoch(self._epoch)
                self._iterator = iter(self._documents(self._train))
            for text in self._iterator:
                if split_hash(text) >= self.config.val_fraction:
                    return text
            self._iterator = None
            self._epoch += 1
        raise CorpusError(
            f"{', '.join(self.config.paths)} holds no training text (every document is validation)"
        )

    def next_batch(self, batch_size: int, seq_len: int) -> Tensor:
        window = seq_len + 1
        need = batch_size * seq_len + 1
        while len(self._buffer) < need:
            self._buffer.extend(self._tokenizer.encode(self._next_train_text() + "\n"))
        flat = torch.tensor(self._buffer[:need], dtype=torch.int64)
        del self._buffer[: batch_size * seq_len]  # the last token starts the next batch
        self.microbatches += 1
        starts = torch.arange(batch_size) * seq_len
        return flat[starts[:, None] + torch.arange(window)]  # (B, T + 1)

    def val_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[Tensor]:
        """The validation documents from the start of the (unshuffled) stream, enough for ``num_batches``
        (fewer if the data holds fewer; windows then overlap), evenly spaced as ByteCorpus does."""
        need = num_batches * batch_size * (seq_len + 1)
        if self._val is None or self._val.numel() < need:
            ids: list[int] = []
            for text in self._documents(self._source):
                if split_hash(text) < self.config.val_fraction:
                    ids.extend(self._tokenizer.encode(text + "\n"))
                    if len(ids) >= need:
                        break
            if len(ids) < seq_len + 1:
                raise CorpusError(
                    f"{', '.join(self.config.paths)} holds {len(ids)} validation tokens, fewer than one window "
                    f"of seq_len + 1 = {seq_len + 1}; raise --val-fraction or add data"
                )
            self._val = torch.tensor(ids, dtype=torch.int32)
        holder = ByteCorpus(self._val, self._val, train_files=0, val_files=0)
        return holder.val_batches(batch_size, seq_len, num_batches)

    def describe(self) -> str:
        return f"streaming {', '.join(self.config.paths)} (epoch {self._epoch})"

    def state_dict(self) -> dict:
        return {
            "microbatches": self.microbatches,
            "epoch": self._epoch,
            "dataset": self._train.state_dict(),
            "buffer": list(self._buffer),
        }

    def load_state_dict(self, state: dict) -> None:
        self.microbatches = int(state["microbatches"])
        self._epoch = int(state["epoch"])
        self._train.set_epoch(self._epoch)
        self._train.load_state_dict(state["dataset"])
        self._iterator = None  # the next read resumes where the state says
        self._buffer = [int(i) for i in state["buffer"]]


Feed = RandomWindows | StreamWindows


def open_feed(
    config: DataConfig, tokenizer: Tokenizer, corpus: ByteCorpus | None, seed: int
) -> Feed:
    """The feed of ``config``: a stream when ``config.streaming``, else random windows of ``corpus``."""
    if config.streaming:
        return StreamWindows(config, tokenizer, seed)
    if corpus is None:
        raise ValueError("a feed that does not stream needs the loaded corpus")
    index, count = config.shard_part()
    return RandomWindows(corpus.shard(index, count) if count > 1 else corpus, seed)


def data_fingerprint(config: DataConfig, tokenizer: Tokenizer) -> dict:
    """What a saved position is only valid for: the same data, read the same way, tokenized the same way."""
    return {
        "paths": [str(Path(p).expanduser().resolve()) for p in config.paths],
        "format": config.resolved_format(),
        "text_field": config.text_field,
        "streaming": config.streaming,
        "val_fraction": config.val_fraction,
        "max_bytes": config.max_bytes,
        "shard": list(config.shard_part()),
        "tokenizer": tokenizer.fingerprint if not isinstance(tokenizer, ByteTokenizer) else "bytes",
    }


class FeedState:
    """A feed's position in a JSON file: ``{"format", "seed", "data", "feed"}``."""

    def __init__(self, path: str | Path, fingerprint: dict):
        self.path = Path(path).expanduser()
        self.fingerprint = fingerprint

    def load(self) -> dict | None:
        """The saved state (``seed`` and ``feed``), or None when there is no file. CorpusError when the file
        is unreadable or was written for other data."""
        try:
            blob = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise CorpusError(
                f"cannot read the data state {self.path}: {e}; delete it to start the data afresh"
            ) from None
        if not isinstance(blob, dict) or blob.get("format") != STATE_FORMAT:
            raise CorpusError(
                f"{self.path} is not a swarm data state; delete it or pass another --data-state"
            )
        if blob.get("data") != self.fingerprint:
            raise CorpusError(
                f"the data state {self.path} was written for other data ({blob.get('data')}), not "
                f"{self.fingerprint}; pass another --data-state, or delete it to start this data afresh"
            )
        return blob

    def save(self, seed: int, feed: Feed) -> None:
        blob = {
            "format": STATE_FORMAT,
            "seed": seed,
            "data": self.fingerprint,
            "feed": feed.state_dict(),
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(blob) + "\n")
        os.replace(tmp, self.path)
