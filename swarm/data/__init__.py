"""Byte-level text corpus: the Python stdlib sources by default, or user files and folders."""

from typing import TYPE_CHECKING

from swarm.data.config import DataConfig
from swarm.data.files import CorpusError, default_corpus_root
from swarm.lazy import lazy_exports

if TYPE_CHECKING:
    from swarm.data.corpus import ByteCorpus

__getattr__ = lazy_exports(globals(), {"ByteCorpus": "swarm.data.corpus"})  # torch: on first use

__all__ = ["ByteCorpus", "CorpusError", "DataConfig", "default_corpus_root"]
