"""The byte corpus: file discovery, the by-file split, sampling and validation batches."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from swarm.data import ByteCorpus, CorpusError, DataConfig, default_corpus_root
from swarm.data.files import find_source_files, split_files, split_hash


def _write_tree(root: Path, count: int = 60, size: int = 200) -> dict[str, bytes]:
    """`count` small text files in nested folders; returns {relative path: content}."""
    files = {}
    for i in range(count):
        rel = f"pkg{i % 4}/sub{i % 3}/file{i}.txt"
        content = (f"# file {i}\n" + "".join(chr(97 + (i + j) % 26) for j in range(size))).encode()
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        files[rel] = content
    return files


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(val_fraction=0.0), r"val_fraction must be in \(0, 1\), got 0.0"),
        (dict(val_fraction=1.5), r"val_fraction must be in \(0, 1\), got 1.5"),
        (dict(max_bytes=1), r"max_bytes must be None or an int >= 2 .*got 1"),
        (dict(paths="corpus.txt"), r"sequence of paths, got the single path 'corpus.txt'"),
        (dict(paths=("",)), r"empty path"),
    ],
)
def test_data_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)


def test_data_config_normalises_paths_to_strings(tmp_path):
    assert DataConfig(paths=[tmp_path, "b"]).paths == (str(tmp_path), "b")


# ---------------------------------------------------------------- split


def test_split_is_deterministic_disjoint_and_independent_of_order(tmp_path):
    _write_tree(tmp_path)
    files = find_source_files([str(tmp_path)])
    train, val = split_files(files, 0.2)
    shuffled = list(files)
    random.Random(1).shuffle(shuffled)
    train2, val2 = split_files(shuffled, 0.2)
    assert {f.key for f in train} == {f.key for f in train2} and {f.key for f in val} == {
        f.key for f in val2
    }
    assert not {f.key for f in train} & {f.key for f in val}
    assert len(train) + len(val) == 60 and 1 <= len(val) < 30
    assert all(split_hash(f.key) < 0.2 for f in val) and all(
        split_hash(f.key) >= 0.2 for f in train
    )


def test_split_keys_are_relative_so_the_folder_location_does_not_matter(tmp_path):
    _write_tree(tmp_path / "a")
    _write_tree(tmp_path / "elsewhere" / "b")
    val_a = {f.key for f in split_files(find_source_files([str(tmp_path / "a")]), 0.2)[1]}
    val_b = {
        f.key for f in split_files(find_source_files([str(tmp_path / "elsewhere" / "b")]), 0.2)[1]
    }
    assert val_a == val_b


def test_both_splits_are_non_empty_even_when_hashing_puts_all_files_on_one_side(tmp_path):
    _write_tree(tmp_path, count=3)
    files = find_source_files([str(tmp_path)])
    train, val = split_files(files, 1e-9)  # no file hashes this low: the smallest hash moves to val
    assert len(val) == 1 and len(train) == 2
    assert val[0].key == min(files, key=lambda f: split_hash(f.key)).key
    train, val = split_files(files, 1 - 1e-9)  # every file hashes below: the largest moves to train
    assert len(train) == 1 and len(val) == 2


def test_loaded_corpus_holds_exactly_the_files_of_each_split(tmp_path):
    contents = _write_tree(tmp_path)
    corpus = ByteCorpus.load(DataConfig(paths=(str(tmp_path),), val_fraction=0.2))
    train, val = split_files(find_source_files([str(tmp_path)]), 0.2)
    assert bytes(corpus.split("val").tolist()) == b"".join(contents[f.key] for f in val)
    assert bytes(corpus.split("train").tolist()) == b"".join(contents[f.key] for f in train)
    assert (corpus.train_files, corpus.val_files) == (len(train), len(val))
    assert corpus.split_by_file


def test_a_single_file_is_cut_in_two(tmp_path):
    path = tmp_path / "only.txt"
    path.write_bytes(b"abcdefghij" * 100)
    corpus = ByteCorpus.load(DataConfig(paths=(str(path),), val_fraction=0.1))
    assert (corpus.train_bytes, corpus.val_bytes) == (900, 100)
    assert not corpus.split_by_file and "cut in two" in corpus.describe()


# ---------------------------------------------------------------- user paths


def test_folder_walk_skips_hidden_binary_and_pycache(tmp_path):
    (tmp_path / "keep.txt").write_bytes(b"hello text\n" * 10)
    (tmp_path / "other.md").write_bytes(b"# more text\n" * 10)
    (tmp_path / ".hidden.txt").write_bytes(b"HIDDEN" * 10)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_bytes(b"GITCONFIG" * 10)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.txt").write_bytes(b"CACHED" * 10)
    (tmp_path / "image.png").write_bytes(b"\x89PNG\x00\x00BINARY" * 10)
    (tmp_path / "empty.txt").write_bytes(b"")
    keys = sorted(f.key for f in find_source_files([str(tmp_path)]))
    assert keys == ["image.png", "keep.txt", "other.md"]  # binary is detected when reading
    corpus = ByteCorpus.load(DataConfig(paths=(str(tmp_path),), val_fraction=0.3))
    text = bytes(corpus.split("train").tolist()) + bytes(corpus.split("val").tolist())
    assert sorted(text) == sorted(b"hello text\n" * 10 + b"# more text\n" * 10)


def test_several_paths_and_duplicates(tmp_path):
    _write_tree(tmp_path / "dir", count=10)
    extra = tmp_path / "notes.txt"
    extra.write_bytes(b"notes\n" * 50)
    files = find_source_files([str(tmp_path / "dir"), str(extra), str(extra)])
    assert len(files) == 11 and sum(f.key == "notes.txt" for f in files) == 1


def _bad_path(root: Path, kind: str) -> Path:
    if kind == "empty-folder":
        (root / "e").mkdir()
        return root / "e"
    if kind == "empty-file":
        (root / "z.txt").write_bytes(b"")
        return root / "z.txt"
    if kind == "binary-file":
        (root / "b.bin").write_bytes(b"a\x00b" * 9)
        return root / "b.bin"
    return root / "missing"


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", r"data path .*missing does not exist"),
        ("empty-folder", r"data folder .*e contains no non-empty, non-hidden files"),
        ("empty-file", r"data file .*z.txt is empty"),
        ("binary-file", r"data file .*b.bin looks binary \(contains NUL bytes\)"),
    ],
)
def test_bad_user_paths_raise_corpus_error(tmp_path, kind, message):
    with pytest.raises(CorpusError, match=message):
        ByteCorpus.load(DataConfig(paths=(str(_bad_path(tmp_path, kind)),)))


def test_folder_with_only_binary_files_has_no_usable_text(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\x00\x01" * 10)
    (tmp_path / "b.bin").write_bytes(b"\x00\x02" * 10)
    with pytest.raises(CorpusError, match="no usable text found in"):
        ByteCorpus.load(DataConfig(paths=(str(tmp_path),)))


def test_max_bytes_caps_each_split(tmp_path):
    _write_tree(tmp_path, count=40, size=500)
    corpus = ByteCorpus.load(DataConfig(paths=(str(tmp_path),), val_fraction=0.1, max_bytes=2000))
    assert (corpus.train_bytes, corpus.val_bytes) == (1800, 200)


# ---------------------------------------------------------------- default corpus


def test_default_corpus_is_the_stdlib_without_site_packages():
    files = find_source_files([])
    assert all(f.key.endswith(".py") and "site-packages" not in f.key for f in files)
    assert {"json/decoder.py", "os.py"} <= {f.key for f in files}
    assert all(f.path.is_relative_to(default_corpus_root()) for f in files)
    corpus = ByteCorpus.load(DataConfig())  # the whole stdlib: ~30 MB, well under a second here
    assert corpus.train_bytes > 5_000_000 and corpus.val_bytes > 20_000 and corpus.val_files >= 5


def test_capped_default_corpus_loads_fast_and_small():
    corpus = ByteCorpus.load(DataConfig(max_bytes=100_000))
    assert (corpus.train_bytes, corpus.val_bytes) == (98_000, 2_000)


# ---------------------------------------------------------------- sampling


@pytest.fixture()
def corpus() -> ByteCorpus:
    train = bytes(range(256)) * 20
    val = bytes((i * 7) % 256 for i in range(3000))
    return ByteCorpus.from_bytes(train, val)


def test_sample_shapes_dtype_range_and_windows(corpus):
    batch = corpus.sample("train", 8, 32, torch.Generator().manual_seed(0))
    assert batch.shape == (8, 33) and batch.dtype == torch.int64
    assert int(batch.min()) >= 0 and int(batch.max()) <= 255
    # The train split is 0..255 repeated, so every window is consecutive bytes modulo 256.
    assert torch.equal(batch[:, 1:], (batch[:, :-1] + 1) % 256)
    again = corpus.sample("train", 8, 32, torch.Generator().manual_seed(0))
    other = corpus.sample("train", 8, 32, torch.Generator().manual_seed(1))
    assert torch.equal(batch, again) and not torch.equal(batch, other)


def test_sample_errors(corpus):
    g = torch.Generator()
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'val'\), got 'test'"):
        corpus.sample("test", 2, 8, g)
    with pytest.raises(
        CorpusError, match=r"val split has 3000 bytes, fewer than one window of seq_len \+ 1 = 3001"
    ):
        corpus.sample("val", 2, 3000, g)
    assert corpus.sample("val", 2, 2999, g).shape == (2, 3000)  # exactly one window fits


def test_val_batches_are_deterministic_and_evenly_spaced(corpus):
    batches = corpus.val_batches(4, 16, 3)
    assert len(batches) == 3 and all(b.shape == (4, 17) and b.dtype == torch.int64 for b in batches)
    assert all(
        torch.equal(a, b) for a, b in zip(batches, corpus.val_batches(4, 16, 3), strict=True)
    )
    val = corpus.split("val").long()
    windows = torch.cat(batches)  # (12, 17)
    assert torch.equal(windows[0], val[:17]) and torch.equal(windows[-1], val[-17:])
    starts = [(3000 - 17) * i // 11 for i in range(12)]
    assert all(torch.equal(w, val[s : s + 17]) for w, s in zip(windows, starts, strict=True))
