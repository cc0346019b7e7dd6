"""Where a stage computes and in which precision: ``--device auto|cpu|cuda[:N]|mps`` and ``--dtype fp32|bf16|fp16``.

Parameters, their gradients and optimizer state stay float32 (the master weights) whatever the compute dtype: a
lower dtype only runs the forward (and so the backward) under :func:`torch.autocast`. What crosses the wire is
float32 on the host, encoded by the run's codec, so peers computing in different dtypes or on different devices
serve the same run. fp16's narrow range needs loss scaling (:class:`GradScale`); bf16 does not.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from swarm.compression.base import all_finite
from swarm.model.devicespec import check_device_spec, check_dtype_name

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(spec: str) -> torch.device:
    """The torch device ``spec`` names; ``auto`` is the first GPU torch sees (CUDA, then MPS), else the CPU.
    Raises ValueError for a device this machine lacks, saying which it has."""
    check_device_spec(spec)
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ValueError(
                f"--device {spec}: this machine has {count} CUDA device(s) visible to torch; "
                f"pick cuda:0..cuda:{count - 1}, or --device cpu"
                if count
                else f"--device {spec}: torch sees no CUDA device here (a CPU-only build, or no GPU); use --device cpu"
            )
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {spec}: torch sees no MPS device here; use --device cpu")
    return device


@dataclass(frozen=True)
class Compute:
    """A device and a compute dtype, and the moves between them and the host (the wire's side)."""

    device: torch.device
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_flags(cls, device: str = "cpu", dtype: str = "fp32") -> Compute:
        check_dtype_name(dtype)
        resolved = resolve_device(device)
        if DTYPES[dtype] == torch.float16 and resolved.type == "cpu":
            # CPU autocast supports fp16 in recent torch, but it is slow and gains nothing; bf16 is the CPU choice
            raise ValueError("--dtype fp16 needs a GPU; on the CPU use --dtype bf16 (or fp32)")
        return cls(resolved, DTYPES[dtype])

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self):
        """The context the stage's forward runs in: autocast to the compute dtype (nothing for fp32)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        """A host tensor on the compute device. From pinned memory and without blocking on CUDA, so the copy
        overlaps the kernels queued before it (the stream orders it before its use)."""
        if x.device == self.device:
            return x
        if self.is_cuda:
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A device tensor back on the host in the wire's dtype (float32 for floating tensors, whatever the
        compute dtype), ready for the codec. On CUDA through a pinned buffer, then one wait for the stream."""
        wire_dtype = torch.float32 if t.is_floating_point() else t.dtype
        if t.device.type == "cpu":
            return t.to(wire_dtype)
        if self.is_cuda:
            out = torch.empty(t.shape, dtype=wire_dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
            torch.cuda.current_stream(t.device).synchronize()
            return out
        return t.to("cpu", wire_dtype)

    def synchronize(self) -> None:
        """Wait for the device's queued work (timings on CUDA would otherwise measure only the launches)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()


CPU = Compute(torch.device("cpu"))


class GradScale:
    """Dynamic loss scaling for fp16 compute, per stage. A stage's backward starts from a scaled output
    gradient (or loss), so small gradients do not underflow fp16; the results are divided back in float32. A
    non-finite result halves the scale and the backward is tried again (the graph is kept for it); after
    ``growth_interval`` clean backwards the scale doubles. Off (scale 1, one try) for fp32 and bf16."""

    def __init__(self, enabled: bool, *, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self._clean = 0

    def grad(self, out: torch.Tensor, wrt: list[torch.Tensor], grad_output: torch.Tensor | None):
        """``torch.autograd.grad(out, wrt, grad_output)`` (unused inputs give None), loss-scaled when enabled.
        Raises FloatingPointError when even scale 1 gives a non-finite gradient (the inputs are to blame)."""
        if not self.enabled:
            if grad_output is not None:
                grad_output = grad_output.to(out.dtype)
            return torch.autograd.grad(out, wrt, grad_output, allow_unused=True)
        seed = (
            torch.ones_like(out, dtype=torch.float32)
            if grad_output is None
            else grad_output.float()
        )
        while True:
            last_try = self.scale <= 1.0
            grads = torch.autograd.grad(
                out,
                wrt,
                (seed * self.scale).to(out.dtype),
                allow_unused=True,
                retain_graph=not last_try,
            )
            grads = [None if g is None else g.float() / self.scale for g in grads]
            if all(g is None or all_finite(g) for g in grads):
                self._clean += 1
                if self._clean >= self.growth_interval:
                    self.scale, self._clean = self.scale * 2, 0
                return grads
            self._clean = 0
            if last_try:
                raise FloatingPointError("the gradient is not finite even unscaled")
            self.scale = max(self.scale / 2, 1.0)
