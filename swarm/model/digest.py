"""A short fingerprint of a stage's parameters, so anyone can check that the replicas of a stage agree.

``state_digest`` hashes, tensor by tensor in the state dict's order, each name, dtype, shape and the tensor's
exact bytes (blake2b, 8 bytes, 16 hex characters). Two replicas with bit-identical parameters have the same
digest; a single changed bit, name, dtype or shape changes it. It says nothing about closeness: replicas that
differ by rounding differ.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

import torch

DIGEST_HEX_CHARS = 16
_DIGEST = re.compile(rf"[0-9a-f]{{{DIGEST_HEX_CHARS}}}")


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """The digest of ``state`` (e.g. ``stage_module.state_dict()``), in its iteration order. Copies each tensor
    to the CPU if it is elsewhere; reads it in place otherwise."""
    h = hashlib.blake2b(digest_size=DIGEST_HEX_CHARS // 2)
    for name, tensor in state.items():
        t = tensor.detach()
        # the header keeps tensors apart: the same bytes under another name, dtype or shape hash differently
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def is_digest(value: str) -> bool:
    """Whether ``value`` has the form :func:`state_digest` returns."""
    return _DIGEST.fullmatch(value) is not None
