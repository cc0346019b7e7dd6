"""Tokenizers: bytes (the default, ids 0..255) or a local Hugging Face ``tokenizers`` directory.

A tokenizer directory is what ``tokenizers.Tokenizer.save`` or ``transformers``' ``save_pretrained`` writes: it
must hold ``tokenizer.json``. Nothing is downloaded: only that file is read. Its vocabulary (``vocab_size``,
added tokens included) must equal the run's model's, so every id it emits has an embedding row and every
logit a token (see :func:`check_vocab`).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from swarm.data.files import CorpusError

TOKENIZER_JSON = "tokenizer.json"
# files of a transformers tokenizer directory worth carrying into an export (those that exist are copied)
TOKENIZER_FILES = (
    TOKENIZER_JSON,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


class ByteTokenizer:
    """One token per byte of the UTF-8 text (ids 0..255); the default."""

    name = "bytes"
    vocab_size = 256
    fingerprint = "bytes"
    directory: Path | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogateescape"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` read from ``DIR/tokenizer.json``."""

    def __init__(self, directory: Path, tokenizer):
        self.directory = directory
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.name = str(directory)
        blob = (directory / TOKENIZER_JSON).read_bytes()
        self.fingerprint = f"sha256:{hashlib.sha256(blob).hexdigest()[:16]}"

    @classmethod
    def load(cls, directory: str | Path) -> HFTokenizer:
        """The tokenizer of ``directory``; CorpusError (a ValueError) saying what is wrong when it cannot be
        read."""
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise CorpusError(
                "--tokenizer needs Hugging Face tokenizers: pip install 'swarm[hf]'"
            ) from None
        path = Path(directory).expanduser()
        if not path.is_dir():
            what = "is a file" if path.exists() else "does not exist"
            raise CorpusError(
                f"--tokenizer {directory} {what}; pass the directory holding {TOKENIZER_JSON} "
                f"(what tokenizers' Tokenizer.save or transformers' save_pretrained writes)"
            )
        if not (path / TOKENIZER_JSON).is_file():
            raise CorpusError(
                f"--tokenizer {directory} has no {TOKENIZER_JSON}; save the tokenizer there with "
                f"transformers' tokenizer.save_pretrained(DIR) or tokenizers' Tokenizer.save(DIR/{TOKENIZER_JSON})"
            )
        try:
            tok = Tokenizer.from_file(str(path / TOKENIZER_JSON))
        except Exception as e:  # tokenizers raises its own Exception subclass for a bad file
            raise CorpusError(f"cannot read {path / TOKENIZER_JSON} as a tokenizer: {e}") from None
        return cls(path, tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def copy_to(self, out: Path) -> list[str]:
        """Copy this tokenizer's files into ``out``; the names copied."""
        copied = []
        for name in TOKENIZER_FILES:
            if (self.directory / name).is_file():
                shutil.copyfile(self.directory / name, out / name)
                copied.append(name)
        return copied


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(directory: str | Path | None) -> Tokenizer:
    """Bytes when ``directory`` is None, else the tokenizer saved there."""
    return ByteTokenizer() if directory is None else HFTokenizer.load(directory)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """CorpusError unless the tokenizer fits the run's model: a tokenizer directory's vocabulary must equal
    the model's ``vocab_size``; bytes need at least 256 ids (the built-in presets have exactly 256)."""
    if isinstance(tokenizer, ByteTokenizer):
        if model_vocab_size < 256:
            raise CorpusError(
                f"the run's model has vocab_size {model_vocab_size}, too small for byte-level data (256 ids); "
                f"train it with --tokenizer DIR whose vocabulary has {model_vocab_size} tokens"
            )
        return
    if tokenizer.vocab_size != model_vocab_size:
        raise CorpusError(
            f"the tokenizer in {tokenizer.directory} has {tokenizer.vocab_size} tokens but the run's model has "
            f"vocab_size {model_vocab_size}: start a new run whose model has vocab_size {tokenizer.vocab_size} "
            f'(swarm peer --model-config with "vocab_size": {tokenizer.vocab_size}), or train this run with a '
            f"tokenizer of {model_vocab_size} tokens"
        )
