"""A tiny local tokenizer and jsonl dataset for the data tests (tests/test_data_hf.py, tests/test_data_live.py):
the tokenizer is a small BPE trained here on a few lines, never downloaded."""

import json
from pathlib import Path

LINES = [
    f"the {animal} number {i} jumps over the {thing} and sleeps near the river bank"
    for i in range(200)
    for animal, thing in [(("fox", "cat", "dog", "owl")[i % 4], ("log", "fence", "wall")[i % 3])]
]


def make_tokenizer(path: Path, vocab_size: int = 320) -> Path:
    """A tiny byte-level BPE trained on LINES, saved as ``path/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(LINES, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def write_jsonl(path: Path, field: str = "text", lines=LINES) -> Path:
    path.write_text(
        "".join(json.dumps({field: line, "id": i}) + "\n" for i, line in enumerate(lines))
    )
    return path
