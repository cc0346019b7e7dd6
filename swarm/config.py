"""The run configuration: what every peer and trainer of one run must agree on.

It is published in the DHT under the run id by whoever starts the run (the first ``swarm peer`` given
``--preset``, or ``swarm demo``); everyone else reads it from there, so a newcomer needs only the run id and a
bootstrap address.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from swarm.compression import BYTES_PER_VALUE, CODEC_NAMES, UnknownCodecError
from swarm.model import MODEL_PRESETS, AnyModelConfig
from swarm.model.config import token_id_bytes
from swarm.schema import parse_dataclass


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    FLAG_TITLE = "new run (with --preset; ignored when the run exists)"

    model: AnyModelConfig = field(default_factory=lambda: MODEL_PRESETS["tiny"])  # the staged model
    # wire codec for activations and gradients (int4/int2: 4/2 bits per value; *sr: stochastic rounding)
    codec: str = field(default="none", metadata={"choices": CODEC_NAMES})
    # wire codec for gradients crossing stage cuts, if not --codec (e.g. int4 activations, int8 gradients)
    grad_codec: str = field(default="same", metadata={"choices": ("same", *CODEC_NAMES)})
    target_batch_size: int = 32  # samples a stage accumulates before each optimizer step
    lr: float = 1e-3  # peak AdamW learning rate
    # AdamW weight decay on parameters of 2+ dimensions (matrices and embeddings), not on biases or norms
    weight_decay: float = 0.1
    warmup_steps: int = 10  # optimizer steps of linear warmup
    # steps of cosine decay to 10% of lr after warmup; 0 = constant after warmup
    total_steps: int = 0
    # bound on the global gradient norm; each stage clips to it / sqrt(stages) (0 = off)
    max_grad_norm: float = 1.0

    def __post_init__(self):
        if self.codec not in CODEC_NAMES:
            raise ValueError(
                f"codec '{self.codec}' is unknown; choose one of {', '.join(CODEC_NAMES)}"
            )
        if self.grad_codec != "same" and self.grad_codec not in CODEC_NAMES:
            raise ValueError(
                f"grad_codec '{self.grad_codec}' is unknown; choose same or one of {', '.join(CODEC_NAMES)}"
            )
        if self.target_batch_size < 1:
            raise ValueError(f"target_batch_size must be >= 1, got {self.target_batch_size}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError(
                f"weight_decay ({self.weight_decay}) and max_grad_norm ({self.max_grad_norm}) "
                f"must be >= 0"
            )
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) and total_steps ({self.total_steps}) "
                f"must be >= 0"
            )

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["model"] = self.model.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any) -> RunConfig:
        """Parse a record read from the DHT (or a checkpoint) by :func:`swarm.schema.parse_dataclass`'s rule:
        unknown fields, here and in ``model``, are left out with a warning (newer versions may add some);
        ill-typed or missing ones (``model`` is required) raise ValueError naming them. A codec this build
        does not know raises ``UnknownCodecError``: this process could neither decode nor send what the run's
        peers exchange, so it must not join (a newer version of swarm may know the codec)."""
        for key, what in (("codec", "activations and gradients"), ("grad_codec", "gradients")):
            codec = data.get(key) if isinstance(data, dict) else None
            if isinstance(codec, str) and codec not in CODEC_NAMES and codec != "same":
                raise UnknownCodecError(
                    f"the run compresses {what} with codec '{codec}', which this version of swarm cannot "
                    f"decode (it knows {', '.join(CODEC_NAMES)}): upgrade swarm on this machine to join the run"
                )
        return parse_dataclass(cls, data, what="run config", required=("model",))

    @property
    def gradient_codec(self) -> str:
        """The codec of the gradients crossing stage cuts: ``grad_codec``, or ``codec`` when it is "same"."""
        return self.codec if self.grad_codec == "same" else self.grad_codec

    def activation_bytes_ratio(self) -> float:
        """How many times fewer bytes an activation crossing a stage cut takes on the wire than at full width
        in float32 (the run's codec, times d_model / bottleneck_dim when the model has a bottleneck; with the
        subspace cut, subspace_dim values and the token id per token)."""
        width = self.model.bottleneck_dim or self.model.subspace_dim or self.model.d_model
        per_token = BYTES_PER_VALUE[self.codec] * width
        if (
            self.model.subspace_dim is not None or self.model.bottleneck_tokens
        ):  # and the token id (swarm.model.subspace.token_wire_dtype)
            per_token += token_id_bytes(self.model.vocab_size)
        return 4.0 * self.model.d_model / per_token

    def compression_scheme(self) -> str:
        """The run's compression in words, e.g. ``codec int4, bottleneck 28 of 128 dims: 32.5x fewer activation
        bytes than float32``."""
        bottleneck, subspace = self.model.bottleneck_dim, self.model.subspace_dim
        cut = (
            "" if bottleneck is None else f", bottleneck {bottleneck} of {self.model.d_model} dims"
        )
        if bottleneck is not None and self.model.bottleneck_tokens:
            cut += " + token ids"
        if subspace is not None:
            cut = f", subspace {subspace} of {self.model.d_model} dims + token ids"
        grads = "" if self.gradient_codec == self.codec else f" (gradients {self.gradient_codec})"
        return (
            f"codec {self.codec}{grads}{cut}: {self.activation_bytes_ratio():.1f}x fewer activation bytes "
            f"than float32"
        )

    def fingerprint(self) -> str:
        """Short hash peers announce, so a trainer can tell peers of an incompatible config apart."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
