"""Byte-level text corpus: the Python stdlib sources by default, or user files and folders."""

from swarm.data.config import DataConfig
from swarm.data.corpus import ByteCorpus
from swarm.data.files import CorpusError, default_corpus_root

__all__ = ["ByteCorpus", "CorpusError", "DataConfig", "default_corpus_root"]
