"""Real data through real peers (in this process: a real DHT, real gRPC): a local jsonl dataset with a local
tokenizer trains (the loss falls), a restarted trainer continues its data where it stopped, and the export
carries the tokenizer that `swarm generate` then uses."""

from __future__ import annotations

import pytest
import torch
from tokdata import make_tokenizer, write_jsonl

from swarm.averaging.config import AveragingConfig
from swarm.config import RunConfig
from swarm.coordinator.export import export_run, generate_text
from swarm.data import CorpusError, DataConfig
from swarm.data.feed import RandomWindows
from swarm.data.hfdata import load_token_corpus
from swarm.data.tokenizer import load_tokenizer
from swarm.discovery.dht import DHTConfig
from swarm.model import ModelConfig
from swarm.peer.config import PeerConfig
from swarm.peer.lifecycle import Peer
from swarm.trainer.data import TrainerData
from swarm.trainer.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.integration

MICROBATCH = 8


def _trainer(data: DataConfig, steps: int, **fields) -> TrainerConfig:
    return TrainerConfig(
        run_id="tokens",
        microbatch_size=MICROBATCH,
        in_flight=2,
        steps=steps,
        eval_every_steps=0,
        eval_batches=1,
        log_every_s=60,
        heartbeat_s=0,
        data=data,
        **fields,
    )


def test_jsonl_with_a_local_tokenizer_trains_resumes_and_exports(loop_thread, boot, tmp_path):
    tokdir = make_tokenizer(tmp_path / "tok")
    vocab = load_tokenizer(str(tokdir)).vocab_size
    model = ModelConfig(
        d_model=32, n_heads=2, n_layers=2, seq_len=16, num_stages=2, vocab_size=vocab
    )
    run = RunConfig(model=model, target_batch_size=MICROBATCH, warmup_steps=0, lr=3e-3)
    state_path = tmp_path / "trainer.data.json"
    data = DataConfig(
        paths=(str(write_jsonl(tmp_path / "d.jsonl")),),
        tokenizer=str(tokdir),
        data_state=str(state_path),
    )

    def peer_config(stage: int) -> PeerConfig:
        return PeerConfig(
            run_id="tokens",
            stage=stage,
            rebalance=False,
            heartbeat_s=0.3,
            ttl_s=2.0,
            averaging=AveragingConfig(average=False),
            dht=DHTConfig(initial_peers=boot),
        )

    async def start():
        return [await Peer.create(peer_config(0), run=run), await Peer.create(peer_config(1))]

    async def train(config: TrainerConfig):
        async with Trainer.open(config, dht=peers[0].dht) as trainer:
            summary = await trainer.train()
            return summary, trainer.data

    peers = loop_thread.run(start())
    try:
        # a run of another vocabulary is refused before training, saying what to change
        wrong = RunConfig(model=ModelConfig(vocab_size=vocab + 5))
        with pytest.raises(
            CorpusError,
            match=f"has {vocab} tokens but the run's model has vocab_size {vocab + 5}: start a new run",
        ):
            TrainerData.open(_trainer(data, 1), wrong, "t")

        summary, first = loop_thread.run(train(_trainer(data, 30, seed=7)), timeout_s=300)
        assert summary.steps == 30
        assert summary.final_loss < summary.initial_loss - 1.0, summary.losses
        assert state_path.is_file() and first.feed.microbatches == 30

        # restarted (seed from the state file): the data continues after the 30 batches, it does not restart
        corpus = load_token_corpus(data, load_tokenizer(str(tokdir)))
        replay = RandomWindows(corpus, 7)
        seen = [replay.next_batch(MICROBATCH, model.seq_len) for _ in range(32)]
        summary2, second = loop_thread.run(train(_trainer(data, 2)), timeout_s=300)
        assert summary2.steps == 2 and second.seed == 7
        assert second.feed.microbatches == 32
        assert (
            second.feed.state_dict() == replay.state_dict()
        )  # it drew batches 31 and 32 of seed 7
        assert not torch.equal(seen[30], seen[0])

        out = tmp_path / "export"
        loop_thread.run(
            export_run("tokens", DHTConfig(initial_peers=boot), str(out), tokenizer=str(tokdir))
        )
        assert (out / "tokenizer.json").read_bytes() == (tokdir / "tokenizer.json").read_bytes()
        text = generate_text(
            str(out), "the fox", max_new_tokens=8, temperature=0, top_k=None, seed=0
        )
        assert text.startswith("the fox") and len(text) > len("the fox")
    finally:
        for peer in peers:
            loop_thread.run(peer.shutdown())
