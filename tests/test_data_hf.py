"""Real data: a local tokenizer, local datasets (jsonl, text, parquet, streaming), per-trainer feeds that resume.

The tokenizer is a small BPE trained here on a few lines and saved to a temporary directory: nothing is
downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokdata import LINES, make_tokenizer, write_jsonl

from swarm.data import CorpusError, DataConfig
from swarm.data.feed import FeedState, RandomWindows, StreamWindows, data_fingerprint, seed_of
from swarm.data.hfdata import load_token_corpus
from swarm.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_tokenizer_round_trip_and_vocab(tokdir):
    tok = load_tokenizer(str(tokdir))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("the fox jumps")
    assert all(0 <= i < tok.vocab_size for i in ids) and len(ids) < len("the fox jumps")
    assert tok.decode(ids) == "the fox jumps"
    check_vocab(tok, tok.vocab_size)  # fits
    with pytest.raises(
        CorpusError, match=rf"has {tok.vocab_size} tokens but the run's model has vocab_size 256"
    ):
        check_vocab(tok, 256)
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    check_vocab(ByteTokenizer(), 300)
    with pytest.raises(CorpusError, match="too small for byte-level data"):
        check_vocab(ByteTokenizer(), 100)


def test_tokenizer_bad_directories(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(CorpusError, match="has no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CorpusError, match="cannot read .* as a tokenizer"):
        load_tokenizer(str(tmp_path))


def test_jsonl_corpus_tokenized(tmp_path, tokdir):
    data = write_jsonl(tmp_path / "d.jsonl")
    config = DataConfig(paths=(str(data),), val_fraction=0.1)
    assert config.resolved_format() == "json"
    tok = load_tokenizer(str(tokdir))
    corpus = load_token_corpus(config, tok)
    train, val = corpus.split("train"), corpus.split("val")
    assert train.dtype == torch.int32 and int(train.max()) < tok.vocab_size
    assert 0 < val.numel() < train.numel()
    # the split is by document text: every validation document is absent from train
    text = tok.decode(train.tolist())
    val_docs = tok.decode(val.tolist()).strip().split("\n")
    assert val_docs and all(doc not in text for doc in val_docs)
    assert corpus.val_files + corpus.train_files == len(LINES)
    # bytes over the same documents
    byte_corpus = load_token_corpus(config, ByteTokenizer())
    assert byte_corpus.split("train").dtype == torch.uint8
    assert bytes(byte_corpus.split("train")[:20].tolist()).decode().startswith("the ")


def test_text_and_parquet_formats(tmp_path, tokdir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = load_tokenizer(str(tokdir))
    (tmp_path / "lines.txt").write_text("\n".join(LINES) + "\n")
    text = load_token_corpus(
        DataConfig(paths=(str(tmp_path / "lines.txt"),), data_format="text"), tok
    )
    pq.write_table(pa.table({"body": LINES}), tmp_path / "d.parquet")
    parquet = load_token_corpus(
        DataConfig(paths=(str(tmp_path / "d.parquet"),), text_field="body"), tok
    )
    assert torch.equal(text.split("train"), parquet.split("train"))
    # plain files with a tokenizer: tokenized whole
    files = load_token_corpus(DataConfig(paths=(str(tmp_path / "lines.txt"),)), tok)
    assert files.split("train").dtype == torch.int32


def test_bad_data_gives_clear_errors(tmp_path, tokdir):
    tok = load_tokenizer(str(tokdir))
    with pytest.raises(CorpusError, match="does not exist"):
        load_token_corpus(DataConfig(paths=(str(tmp_path / "nope.jsonl"),)), tok)
    data = write_jsonl(tmp_path / "d.jsonl", field="content")
    with pytest.raises(
        CorpusError, match=r"has no column 'text' \(it has content, id\); pass --text-field"
    ):
        load_token_corpus(DataConfig(paths=(str(data),)), tok)
    with pytest.raises(CorpusError, match="has no column 'body'"):
        StreamWindows(DataConfig(paths=(str(data),), text_field="body", streaming=True), tok, 0)
    with pytest.raises(ValueError, match="--streaming reads through Hugging Face datasets"):
        DataConfig(paths=(str(tmp_path),), streaming=True)
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(CorpusError, match="cannot read .* as json data"):
        load_token_corpus(DataConfig(paths=(str(tmp_path / "broken.jsonl"),)), tok)


def test_two_trainers_feed_different_batches_and_resume(tmp_path, tokdir):
    tok = load_tokenizer(str(tokdir))
    config = DataConfig(paths=(str(write_jsonl(tmp_path / "d.jsonl")),))
    corpus = load_token_corpus(config, tok)
    a, b = (RandomWindows(corpus, seed_of(t)) for t in ("trainer-a", "trainer-b"))
    assert seed_of("trainer-a") != seed_of("trainer-b")
    assert not torch.equal(a.next_batch(4, 16), b.next_batch(4, 16))
    # a trainer's position survives a restart: the state file continues the same sequence
    state = FeedState(tmp_path / "a.data.json", data_fingerprint(config, tok))
    state.save(a.seed, a)
    expected = [a.next_batch(4, 16) for _ in range(3)]
    saved = state.load()
    restarted = RandomWindows(corpus, saved["seed"])
    restarted.load_state_dict(saved["feed"])
    assert restarted.microbatches == 1
    assert all(torch.equal(restarted.next_batch(4, 16), e) for e in expected)
    # a state kept for other data is refused
    other = FeedState(tmp_path / "a.data.json", data_fingerprint(config, ByteTokenizer()))
    with pytest.raises(CorpusError, match="was written for other data"):
        other.load()


def test_streaming_feed_resumes_and_differs_by_seed(tmp_path, tokdir):
    tok = load_tokenizer(str(tokdir))
    config = DataConfig(paths=(str(write_jsonl(tmp_path / "d.jsonl")),), streaming=True)
    a = StreamWindows(config, tok, seed=1, buffer_size=50)
    b = StreamWindows(config, tok, seed=2, buffer_size=50)
    first = a.next_batch(2, 16)
    assert first.shape == (2, 17) and int(first.max()) < tok.vocab_size
    assert not torch.equal(first, b.next_batch(2, 16))
    assert torch.equal(
        first[0, -1], first[1, 0]
    )  # consecutive windows: the stream is read in order
    state = json.loads(json.dumps(a.state_dict()))  # what the state file holds
    expected = [a.next_batch(2, 16) for _ in range(3)]
    resumed = StreamWindows(config, tok, seed=1, buffer_size=50)
    resumed.load_state_dict(state)
    got = [resumed.next_batch(2, 16) for _ in range(3)]
    # the dataset position resumes exactly; the shuffle buffer is refilled (datasets does not keep it), so
    # compare what was read: no window of the resumed stream repeats one read before the state was saved
    assert resumed.microbatches == 4
    assert not any(torch.equal(g, first) for g in got)
    kept = min(17, len(state["buffer"]))  # the tokens read but not yet used are kept in the state
    assert kept >= 1 and torch.equal(got[0][0, :kept], expected[0][0, :kept])
    val = a.val_batches(2, 16, 2)
    assert len(val) == 2 and val[0].shape == (2, 17)


def test_trainers_started_alike_read_different_batches_unless_seeded(tmp_path, tokdir):
    from dataclasses import replace

    from swarm.config import RunConfig
    from swarm.discovery.config import DHTConfig
    from swarm.model import ModelConfig
    from swarm.trainer.config import TrainerConfig
    from swarm.trainer.data import TrainerData, state_path_of

    vocab = load_tokenizer(str(tokdir)).vocab_size
    run = RunConfig(model=ModelConfig(vocab_size=vocab, seq_len=16))
    data = DataConfig(paths=(str(write_jsonl(tmp_path / "d.jsonl")),), tokenizer=str(tokdir))
    config = TrainerConfig(data=data)  # default flags: no --seed
    a, b = TrainerData.open(config, run, "peer-a"), TrainerData.open(config, run, "peer-b")
    assert a.seed == seed_of("peer-a") != b.seed
    assert not torch.equal(a.feed.next_batch(8, 16), b.feed.next_batch(8, 16))
    seeded = replace(config, seed=3)
    a, b = TrainerData.open(seeded, run, "peer-a"), TrainerData.open(seeded, run, "peer-b")
    assert torch.equal(a.feed.next_batch(8, 16), b.feed.next_batch(8, 16))
    # the position is kept next to a kept identity by default, and refuses another --seed
    kept = replace(config, dht=DHTConfig(identity_path=str(tmp_path / "trainer.pem")))
    assert state_path_of(kept) == str(tmp_path / "trainer.pem.data.json")
    first = TrainerData.open(kept, run, "peer-a")
    first.feed.next_batch(8, 16)
    first.save()
    again = TrainerData.open(kept, run, "a fresh identity")
    assert again.seed == first.seed and again.feed.microbatches == 1
    with pytest.raises(CorpusError, match=r"continues the data of --seed \d+, not --seed 5"):
        TrainerData.open(replace(kept, seed=5), run, "peer-a")
    assert (
        state_path_of(config) is None
    )  # nothing to resume without a kept identity or --data-state


def test_shards_are_disjoint_parts_of_the_training_data(tmp_path, tokdir):
    from swarm.data.feed import open_feed

    tok = load_tokenizer(str(tokdir))
    path = str(write_jsonl(tmp_path / "d.jsonl"))
    corpus = load_token_corpus(DataConfig(paths=(path,)), tok)
    parts = [corpus.shard(k, 3).split("train") for k in range(3)]
    assert torch.equal(torch.cat(parts), corpus.split("train"))
    feed = open_feed(DataConfig(paths=(path,), shard="1/3"), tok, corpus, seed=0)
    assert torch.equal(feed.corpus.split("train"), parts[1])
    streams = [
        StreamWindows(DataConfig(paths=(path,), streaming=True, shard=f"{k}/2"), tok, seed=0)
        for k in range(2)
    ]
    docs = [set(s._documents(s._train)) for s in streams]
    assert docs[0] and docs[1] and not docs[0] & docs[1]
    for bad in ("3/3", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="--shard must read K/N"):
            DataConfig(shard=bad)
