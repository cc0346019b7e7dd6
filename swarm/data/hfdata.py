"""Local datasets through Hugging Face ``datasets`` (text, JSON lines, parquet), tokenized into a corpus.

Nothing reaches the network: offline mode is set before ``datasets`` is imported and again on its config, and
only local files are named. A document (a line of text, a JSON line's or a parquet row's ``text_field``) goes to
validation iff :func:`swarm.data.files.split_hash` of its text is below ``val_fraction``: the split depends on the
text alone, so every trainer, in any order or shard, holds out the same documents. Documents are joined with a
newline between them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from swarm.data.config import DataConfig
from swarm.data.corpus import ByteCorpus
from swarm.data.files import CorpusError, find_source_files, split_hash
from swarm.data.tokenizer import ByteTokenizer, Tokenizer

_BUILDERS = {"text": "text", "json": "json", "parquet": "parquet"}
_SUFFIXES = {"text": None, "json": (".json", ".jsonl"), "parquet": (".parquet",)}


def offline_datasets():
    """The ``datasets`` module, in offline mode (no hub, no downloads)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError:
        raise CorpusError(
            "reading jsonl, parquet or text datasets needs Hugging Face datasets: pip install 'swarm[hf]'"
        ) from None

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    datasets.utils.logging.disable_progress_bar()
    return datasets


def data_files(config: DataConfig, fmt: str) -> list[str]:
    """The local files of ``config.paths`` (folders walked; for json/parquet only files with their suffixes).
    CorpusError naming the path when one is missing or a folder holds none."""
    if not config.paths:
        raise CorpusError(
            f"--data-format {fmt} needs --data FILE_OR_FOLDER (the default corpus is files)"
        )
    out: list[str] = []
    suffixes = _SUFFIXES[fmt]
    for raw in config.paths:
        found = [s.path for s in find_source_files([raw])]
        if Path(raw).expanduser().is_dir() and suffixes is not None:
            found = [p for p in found if p.suffix.lower() in suffixes]
            if not found:
                raise CorpusError(
                    f"data folder {raw} holds no {'/'.join(suffixes)} files for --data-format {fmt}"
                )
        out.extend(str(p) for p in found)
    return out


def load_dataset(config: DataConfig, *, streaming: bool):
    """The ``datasets`` Dataset (or IterableDataset when streaming) of ``config``'s files, its text column
    checked. CorpusError when the files cannot be read as the format or the column is missing."""
    fmt = config.resolved_format()
    files = data_files(config, fmt)
    datasets = offline_datasets()
    try:
        ds = datasets.load_dataset(
            _BUILDERS[fmt], data_files=files, split="train", streaming=streaming
        )
    except Exception as e:  # datasets wraps parse errors in several types
        raise CorpusError(f"cannot read {', '.join(config.paths)} as {fmt} data: {e}") from None
    field = text_field(config)
    columns = ds.column_names
    if columns is None:  # a stream of JSON lines learns its columns from its first example
        first = next(iter(ds), None)
        if first is None:
            raise CorpusError(f"{', '.join(config.paths)} holds no examples")
        columns = list(first)
    if field not in columns:
        raise CorpusError(
            f"{', '.join(config.paths)} has no column {field!r} (it has {', '.join(map(str, columns))}); "
            f"pass --text-field with the column that holds the text"
        )
    return ds


def text_field(config: DataConfig) -> str:
    return "text" if config.resolved_format() == "text" else config.text_field


def load_token_corpus(config: DataConfig, tokenizer: Tokenizer) -> ByteCorpus:
    """The train/val token corpus of ``config`` read whole (not streaming), tokenized with ``tokenizer``.

    Format ``files`` reads the files as :meth:`ByteCorpus.load` does (bytes stay bytes; with a tokenizer each
    split's text is tokenized). The others read documents through ``datasets`` (see the module docstring);
    ``max_bytes`` caps the characters of text read. CorpusError when no text is left or a split is empty.
    """
    if config.resolved_format() == "files":
        corpus = ByteCorpus.load(config)
        if isinstance(tokenizer, ByteTokenizer):
            return corpus
        splits = [
            _tokens(tokenizer, [bytes(corpus.split(s).numpy()).decode("utf-8", "replace")])
            for s in ("train", "val")
        ]
        return _corpus(*splits, corpus.train_files, corpus.val_files, config)
    ds = load_dataset(config, streaming=False)
    train_docs: list[str] = []
    val_docs: list[str] = []
    chars = 0
    for text in ds[text_field(config)]:
        if not isinstance(text, str) or not text:
            continue
        if config.max_bytes is not None and chars >= config.max_bytes:
            break
        chars += len(text)
        (val_docs if split_hash(text) < config.val_fraction else train_docs).append(text)
    if not train_docs and not val_docs:
        raise CorpusError(
            f"{', '.join(config.paths)} holds no non-empty text in {text_field(config)!r}"
        )
    train, val = _tokens(tokenizer, train_docs), _tokens(tokenizer, val_docs)
    return _corpus(train, val, len(train_docs), len(val_docs), config)


def _tokens(tokenizer: Tokenizer, docs: list[str]) -> torch.Tensor:
    texts = [d + "\n" for d in docs]
    ids = (
        tokenizer.encode_batch(texts)
        if hasattr(tokenizer, "encode_batch")
        else map(tokenizer.encode, texts)
    )
    flat = [i for doc in ids for i in doc]
    dtype = torch.uint8 if isinstance(tokenizer, ByteTokenizer) else torch.int32
    return torch.tensor(flat, dtype=dtype)


def _corpus(train, val, n_train: int, n_val: int, config: DataConfig) -> ByteCorpus:
    """A corpus of the two token tensors; when one is empty (too few documents), the tokens of both are cut,
    the last ``val_fraction`` of them becoming validation."""
    if train.numel() and val.numel():
        return ByteCorpus(train, val, train_files=n_train, val_files=n_val)
    tokens = torch.cat([train, val])
    if tokens.numel() < 2:
        raise CorpusError(
            f"{', '.join(config.paths) or 'the data'} holds fewer than 2 tokens of text"
        )
    cut = min(max(1, math.ceil(tokens.numel() * config.val_fraction)), tokens.numel() - 1)
    return ByteCorpus(
        tokens[:-cut], tokens[-cut:], train_files=n_train + n_val, val_files=1, split_by_file=False
    )
