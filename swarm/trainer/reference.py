"""The single-process twin of a swarm run: the same model, data, global batches, learning-rate schedule and
per-stage optimizers, in one process. It is what the swarm's convergence is measured against
(tests/test_parity.py, bench/convergence.py), and the one-process speed baseline (bench/swarm_throughput.py).

Same data: microbatch i is the trainer's microbatch i (``corpus.sample`` from a generator seeded like
``TrainerConfig.seed``), and global batch e is microbatches ``e * per_step ... (e + 1) * per_step - 1``.
Same optimization: each stage has the optimizer a lone replica has (:class:`swarm.optim.LocalStageOptimizer`:
AdamW, the ``swarm.optim.learning_rate`` schedule, per-stage clipping), fed the same gradient sums weighted by
samples. Same schedule: with ``delay_steps`` d (the trainer's ``--max-batches-ahead``), global batch e computes its
gradient on the parameters after steps on batches ``0 ... e - d - 1`` and is applied d batches later, as averaging
stages do when each batch's all-reduce overlaps the next batch's compute (the trainer pins every batch to those
parameters, see swarm.peer.versions); 0 is lockstep.
Same wire, on request (``wire=True``): each cut's activations and their gradients round-trip the run's codecs as
they cross the swarm's network (:class:`CodecWire`), so what a codec or bottleneck costs in loss can be measured
in one process, many seeds at a time (bench/quality_twin.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarm.compression import get_codec
from swarm.config import RunConfig
from swarm.data import ByteCorpus
from swarm.model import FullModel, build_full_model, evaluate
from swarm.optim import LocalStageOptimizer


@dataclass(kw_only=True)
class ReferenceResult:
    model: FullModel
    losses: list[float]  # mean training loss of each global batch
    # (global batches done, validation loss)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    # wall time of the global batches (forward, backward, steps; validation excluded)
    train_time_s: float = 0.0
    tokens: int = 0  # tokens trained on (samples * seq_len)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_time_s

    @property
    def val_loss(self) -> float:
        return self.val_losses[-1][1]


class CodecWire:
    """A stage cut's wire in one process: the activation a stage sends comes out of ``codec``'s encode and decode
    (the whole tensor, flattened, as the swarm's chunked streams encode it: swarm.transport.tensors), and the
    gradient sent back comes out of ``grad_codec``'s. Token ids that cross beside a bottleneck are joined after
    it (``FullModel.forward``), raw, as on the wire."""

    def __init__(self, codec: str, grad_codec: str) -> None:
        self.codec, self.grad_codec = get_codec(codec), get_codec(grad_codec)

    def __call__(self, activation: torch.Tensor) -> torch.Tensor:
        return _WireRoundTrip.apply(activation, self)

    @staticmethod
    def round_trip(codec, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.detach().contiguous().view(-1)
        return codec.decode(codec.encode(flat), flat.numel(), flat.dtype).view(tensor.shape)


class _WireRoundTrip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation: torch.Tensor, wire: CodecWire) -> torch.Tensor:
        ctx.wire = wire
        return wire.round_trip(wire.codec, activation)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.wire.round_trip(ctx.wire.grad_codec, grad), None


def train_reference(
    run: RunConfig,
    corpus: ByteCorpus,
    *,
    steps: int,
    microbatch_size: int,
    seed: int = 0,
    eval_batches: int = 4,
    eval_every_steps: int = 0,
    clipping: str = "stage",
    delay_steps: int = 0,
    on_step: Callable[[int, float], bool | None] | None = None,
    wire: bool = False,
) -> ReferenceResult:
    """Train ``steps`` global batches as a swarm trainer with ``--microbatch-size microbatch_size --seed seed``
    would send them, validating every ``eval_every_steps`` (0: only at the end) on ``eval_batches`` of the
    trainer's validation batches (0: never). ``clipping``: "stage" clips each stage to
    ``max_grad_norm / sqrt(stages)`` as the swarm does; "global" clips the whole model's gradient to
    ``max_grad_norm`` (exact, for comparison). ``delay_steps``: each batch's gradient is applied that many batches
    after it was computed (see the module); the last ones are applied at the end, before the final validation.
    ``on_step(step, loss)`` is called after every global batch (step counts from 1) with its mean loss; returning
    True stops training there (the result holds the batches done and a validation at that step). ``wire``: each
    cut's activations and gradients round-trip ``run.codec`` and ``run.gradient_codec`` (:class:`CodecWire`), in
    training and validation alike, as in the swarm; False (the default) sends nothing through a codec.
    Two calls with equal arguments give the same losses up to the backend's floating-point nondeterminism."""
    if steps < 1 or microbatch_size < 1:
        raise ValueError(
            f"steps and microbatch_size must be >= 1, got {steps} and {microbatch_size}"
        )
    if clipping not in ("stage", "global"):
        raise ValueError(f"clipping must be 'stage' or 'global', got {clipping!r}")
    if delay_steps < 0:
        raise ValueError(f"delay_steps must be >= 0 (0 = lockstep), got {delay_steps}")
    model = build_full_model(run.model)
    if wire:
        model.wire = CodecWire(run.codec, run.gradient_codec)
    exact = clipping == "global"
    optimizers = [
        LocalStageOptimizer(
            stage_module, dataclasses.replace(run, max_grad_norm=0.0) if exact else run
        )
        for stage_module in model.stages
    ]
    generator = torch.Generator().manual_seed(seed)
    seq_len = run.model.seq_len
    per_step = math.ceil(run.target_batch_size / microbatch_size)
    val_batches = (
        corpus.val_batches(microbatch_size, seq_len, eval_batches) if eval_batches > 0 else []
    )
    result = ReferenceResult(model=model, losses=[])
    # each computed batch not applied yet: for each stage, its gradient sums and samples
    unapplied: deque[list[tuple[list, int]]] = deque()

    def apply_oldest() -> None:
        for optimizer, (grads, n) in zip(optimizers, unapplied.popleft()):
            optimizer.accumulate(grads, n)  # the stage optimizer steps: the batch is its target

    for step in range(1, steps + 1):
        started = time.perf_counter()
        weighted, samples = 0.0, 0
        for _ in range(per_step):
            tokens = corpus.sample("train", microbatch_size, seq_len, generator)  # (B, T + 1)
            n = tokens.shape[0]
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
            # gradient sums weighted by samples, as the peers accumulate them; .grad sums the batch's microbatches
            (loss * n).backward()
            weighted, samples = weighted + float(loss.detach()) * n, samples + n
        scale = 1.0
        if exact:  # clip the batch's mean gradient by the global norm
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = float(
                torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g / samples) for g in grads])
                )
            )
            scale = min(1.0, run.max_grad_norm / (norm + 1e-6)) if run.max_grad_norm > 0 else 1.0
        batch = []
        for stage_module in model.stages:
            grads = [
                p.grad if p.grad is None or scale == 1.0 else p.grad * scale
                for p in stage_module.parameters()
            ]
            for p in stage_module.parameters():
                p.grad = None
            batch.append((grads, samples))
        unapplied.append(batch)
        while len(unapplied) > delay_steps:
            apply_oldest()
        # float(loss) synced the device: the time below is honest
        result.losses.append(weighted / samples)
        result.train_time_s += time.perf_counter() - started
        result.tokens += samples * seq_len
        stop = on_step is not None and on_step(step, result.losses[-1])
        while (
            stop or step == steps
        ) and unapplied:  # the last batches' steps, as the swarm takes them
            apply_oldest()
        if val_batches and (
            stop or step == steps or (eval_every_steps and step % eval_every_steps == 0)
        ):
            result.val_losses.append((step, evaluate(model, val_batches)))
        if stop:
            break
    return result
