"""The trainer's data: its tokenizer (checked against the run's model), its own feed and seed, its kept position."""

from __future__ import annotations

import logging

from swarm.config import RunConfig
from swarm.data.feed import Feed, FeedState, data_fingerprint, open_feed, seed_of
from swarm.data.files import CorpusError
from swarm.data.hfdata import load_token_corpus
from swarm.data.tokenizer import Tokenizer, check_vocab, load_tokenizer
from swarm.trainer.config import TrainerConfig

logger = logging.getLogger(__name__)


def state_path_of(config: TrainerConfig) -> str | None:
    """``--data-state``, or by default ``IDENTITY.data.json`` next to a kept ``--identity-path``."""
    if config.data.data_state is not None:
        return config.data.data_state
    if config.dht.identity_path is not None:
        return f"{config.dht.identity_path}.data.json"
    return None


class TrainerData:
    """What the trainer reads: ``feed`` (seeded with ``seed``), and where its position is kept."""

    def __init__(self, feed: Feed, seed: int, tokenizer: Tokenizer, state: FeedState | None):
        self.feed = feed
        self.seed = seed
        self.tokenizer = tokenizer
        self.state = state

    @classmethod
    def open(cls, config: TrainerConfig, run: RunConfig, trainer_id: str) -> TrainerData:
        """Load the tokenizer and the data (blocking: run it in a thread) and restore a kept position.

        The seed is ``--seed``, else a kept state's, else one derived from ``trainer_id``. CorpusError (a
        ValueError) when the tokenizer does not fit the run's model, the data cannot be read, or a kept state
        belongs to other data or another ``--seed``."""
        data = config.data
        tokenizer = load_tokenizer(data.tokenizer)
        check_vocab(tokenizer, run.model.vocab_size)
        path = state_path_of(config)
        state = None if path is None else FeedState(path, data_fingerprint(data, tokenizer))
        saved = None if state is None else state.load()
        if saved is not None and config.seed is not None and saved.get("seed") != config.seed:
            raise CorpusError(
                f"the data state {state.path} continues the data of --seed {saved.get('seed')}, not "
                f"--seed {config.seed}: pass --seed {saved.get('seed')} (or none), another --data-state, or "
                f"delete it to start afresh"
            )
        if config.seed is not None:
            seed = config.seed
        elif saved is not None:
            seed = int(saved["seed"])
        else:
            seed = seed_of(trainer_id)
        corpus = None if data.streaming else load_token_corpus(data, tokenizer)
        feed = open_feed(data, tokenizer, corpus, seed)
        if saved is not None:
            try:
                feed.load_state_dict(saved["feed"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise CorpusError(
                    f"the data state {state.path} does not fit this data ({e}); delete it to start afresh"
                ) from None
            logger.info(
                "trainer %s resumes its data at microbatch %d (seed %d, from %s)",
                trainer_id,
                feed.microbatches,
                seed,
                state.path,
            )
        else:
            logger.info("trainer %s reads %s with seed %d", trainer_id, feed.describe(), seed)
        return cls(feed, seed, tokenizer, state)

    def save(self) -> None:
        """Keep the feed's position (every window drawn so far counts as read)."""
        if self.state is not None:
            self.state.save(self.seed, self.feed)
