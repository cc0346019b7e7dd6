"""Token-by-token (by default byte-by-byte) sampling from a trained FullModel of any family (no KV cache)."""

from __future__ import annotations

import torch

from swarm.model.full import FullModel


def generate(
    model: FullModel,
    prompt: bytes,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> bytes:
    """Continue `prompt` by `max_new_tokens` bytes and return ONLY the new bytes (see `generate_ids`; only
    the first 256 logits count: a larger vocabulary's other ids never appear in byte-level training data).
    Raises ValueError for an empty prompt, a model whose vocabulary is not bytes, or bad settings."""
    if not isinstance(prompt, (bytes, bytearray)) or len(prompt) == 0:
        raise ValueError("generate needs a non-empty bytes prompt")
    if model.config.vocab_size < 256:
        raise ValueError(
            f"generate samples bytes, so the model needs vocab_size >= 256, got {model.config.vocab_size}"
        )
    new = generate_ids(
        model, list(prompt), max_new_tokens, temperature, top_k, generator, vocab=256
    )
    return bytes(new)


@torch.no_grad()
def generate_ids(
    model: FullModel,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    *,
    vocab: int | None = None,
) -> list[int]:
    """Continue the token ids `prompt` by `max_new_tokens` ids and return ONLY the new ones.

    The context fed to the model is the last `seq_len` ids. Only the first `vocab` logits are sampled (None:
    all). `temperature` 0 means greedy (argmax); otherwise logits are divided by it and, with `top_k`, all but
    the k most likely ids are dropped before sampling with `generator` (a CPU generator; None = global RNG).
    The model is put in eval mode for the call and its previous mode restored.
    Raises ValueError for an empty prompt, ids outside the vocabulary, or bad settings.
    """
    config = model.config
    vocab = config.vocab_size if vocab is None else vocab
    if len(prompt) == 0:
        raise ValueError("generate needs a non-empty prompt")
    if not all(0 <= i < config.vocab_size for i in prompt):
        raise ValueError(
            f"the prompt has token ids outside the model's vocabulary [0, {config.vocab_size})"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be None or in 1..{vocab}, got {top_k}")

    device = next(model.parameters()).device
    tokens = torch.tensor(prompt, dtype=torch.int64, device=device)[None]  # (1, P)
    new = []
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = tokens[:, -config.seq_len :]  # (1, T <= seq_len)
            logits = model(context)[0, -1, :vocab].float().cpu()  # (vocab,)
            if temperature == 0:
                next_id = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_id = int(torch.multinomial(probs, 1, generator=generator))
            new.append(next_id)
            # (1, P + i + 1)
            tokens = torch.cat([tokens, torch.tensor([[next_id]], device=device)], dim=1)
    finally:
        model.train(was_training)
    return new
