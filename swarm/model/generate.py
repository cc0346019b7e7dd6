"""Byte-by-byte sampling from a trained FullModel of any family (no KV cache: simple and fine for demos)."""

from __future__ import annotations

import torch

from swarm.model.full import FullModel


@torch.no_grad()
def generate(
    model: FullModel,
    prompt: bytes,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> bytes:
    """Continue `prompt` by `max_new_tokens` bytes and return ONLY the new bytes.

    The context fed to the model is the last `seq_len` bytes. `temperature` 0 means greedy
    (argmax); otherwise logits are divided by it and, with `top_k`, all but the k most likely
    bytes are dropped before sampling with `generator` (a CPU generator; None = global RNG).
    The model is put in eval mode for the call and its previous mode restored.
    Raises ValueError for an empty prompt, a model whose vocabulary is not bytes, or bad settings.
    """
    config = model.config
    if not isinstance(prompt, (bytes, bytearray)) or len(prompt) == 0:
        raise ValueError("generate needs a non-empty bytes prompt")
    if config.vocab_size < 256:
        raise ValueError(
            f"generate samples bytes, so the model needs vocab_size >= 256, got {config.vocab_size}"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and not 1 <= top_k <= 256:
        raise ValueError(f"top_k must be None or in 1..256, got {top_k}")

    device = next(model.parameters()).device
    tokens = torch.tensor(list(prompt), dtype=torch.int64, device=device)[None]  # (1, P)
    new = []
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = tokens[:, -config.seq_len :]  # (1, T <= seq_len)
            # (256,): a larger vocabulary's other ids never appear in byte-level training data
            logits = model(context)[0, -1, :256].float().cpu()
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
    return bytes(new)
