"""What one stage replica takes in memory, estimated before it is built, and the refusal to start a peer whose
device cannot hold it.

The estimate counts, in bytes on the compute device: the float32 parameters (master weights), the gradient sums
the optimizer accumulates, AdamW's two moments, the copies of the parameters forwards run on (the current
step's and ``kept_param_steps`` older ones, see swarm.peer.versions), the held gradients at their budget
(``held_gradient_bytes``, at least one stage gradient: one is always admitted), the autograd graphs and stage
inputs at their budgets
(``graph_cache_bytes``, ``input_cache_bytes``), the compute-dtype copies of the weights autocast makes, and with
averaging the all-reduce's two buffers (averaged gradients and its copy of the parameters). Activations of the
call being computed are not counted: they are bounded by the graph budget's size per microbatch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch

from swarm.model import AnyModelConfig
from swarm.peer.config import CacheConfig

_GIB = 1 << 30
# the graph budget when --graph-cache-bytes is unset and the stage is not on a GPU, and the least one on a GPU
DEFAULT_GRAPH_CACHE_BYTES = 256 << 20


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Bytes one replica of a stage needs, by what takes them."""

    parameters: int
    gradient_sums: int
    optimizer_state: int
    param_versions: int
    held_gradients: int
    graph_cache: int
    input_cache: int
    autocast_weights: int
    averaging_buffers: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def describe(self) -> str:
        parts = ", ".join(
            f"{name.replace('_', ' ')} {gib(n)}" for name, n in asdict(self).items() if n
        )
        return f"{gib(self.total)} ({parts})"


def gib(n: int) -> str:
    return f"{n / _GIB:.2f} GiB"


def estimate_stage_memory(
    model: AnyModelConfig,
    stage_index: int,
    cache: CacheConfig,
    *,
    compute_dtype: torch.dtype = torch.float32,
    averaging: bool = False,
) -> StageMemory:
    """The :class:`StageMemory` of stage ``stage_index`` of ``model``; builds the stage on the meta device, so
    nothing is allocated."""
    from swarm.model.stage import empty_stage

    params = list(empty_stage(model, stage_index, device="meta").parameters())
    param_bytes = sum(p.numel() * 4 for p in params)  # float32 master weights
    grad_bytes = sum(p.numel() * 4 for p in params if p.requires_grad)
    low_bytes = torch.empty((), dtype=compute_dtype).element_size()
    return StageMemory(
        parameters=param_bytes,
        gradient_sums=grad_bytes,
        optimizer_state=2 * grad_bytes,  # AdamW: first and second moments
        param_versions=(1 + cache.kept_param_steps) * param_bytes,
        held_gradients=max(grad_bytes, cache.held_gradient_bytes),
        graph_cache=DEFAULT_GRAPH_CACHE_BYTES
        if cache.graph_cache_bytes is None
        else cache.graph_cache_bytes,
        input_cache=cache.input_cache_bytes,
        autocast_weights=0 if low_bytes == 4 else param_bytes * low_bytes // 4,
        averaging_buffers=2 * grad_bytes if averaging else 0,
    )


def resolve_graph_cache(
    cache: CacheConfig,
    model: AnyModelConfig,
    stage_index: int,
    device: torch.device,
    *,
    compute_dtype: torch.dtype = torch.float32,
    averaging: bool = False,
    limit_bytes: int | None = None,
) -> CacheConfig:
    """``cache`` with its graph budget set when it was left unset (see :func:`auto_graph_cache_bytes`): on a
    GPU from what the device has free (or ``limit_bytes``, --memory-limit-bytes) beyond the stage's other needs;
    elsewhere :data:`DEFAULT_GRAPH_CACHE_BYTES` (the RAM of a CPU peer is the machine's, shared)."""
    if cache.graph_cache_bytes is not None:
        return cache
    if device.type != "cuda":
        return replace(cache, graph_cache_bytes=DEFAULT_GRAPH_CACHE_BYTES)
    rest = estimate_stage_memory(
        model,
        stage_index,
        replace(cache, graph_cache_bytes=0),
        compute_dtype=compute_dtype,
        averaging=averaging,
    )
    have = limit_bytes if limit_bytes is not None else available_bytes(device)
    return replace(cache, graph_cache_bytes=auto_graph_cache_bytes(have, rest.total))


def auto_graph_cache_bytes(have: int | None, need: int) -> int:
    """Half of what a device with ``have`` bytes free keeps after the ``need`` of everything else (the other half
    for the microbatch being computed, and for the allocator), and at least :data:`DEFAULT_GRAPH_CACHE_BYTES`;
    that when ``have`` is not known. A budget, not an allocation: graphs are kept only while in flight."""
    if have is None:
        return DEFAULT_GRAPH_CACHE_BYTES
    return max(DEFAULT_GRAPH_CACHE_BYTES, (have - need) // 2)


def available_bytes(device: torch.device) -> int | None:
    """Bytes ``device`` can still give: free GPU memory on CUDA, the recommended budget on MPS, the RAM the
    kernel reports available (MemAvailable) on the CPU; None when it cannot tell."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        recommended = getattr(torch.mps, "recommended_max_memory", None)
        return recommended() - torch.mps.driver_allocated_memory() if recommended else None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_total_bytes(device: torch.device) -> int:
    """All the memory of ``device`` (0 = not known), for the record."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 0
    return 0


class InsufficientMemory(ValueError):
    """The device cannot hold the stage: the peer does not start."""


def check_fits(
    estimate: StageMemory, stage_index: int, device: torch.device, limit_bytes: int | None
) -> None:
    """Raise :class:`InsufficientMemory`, saying what to change, when ``estimate`` exceeds ``limit_bytes``
    (--memory-limit-bytes) or, without one, what ``device`` has available."""
    have = limit_bytes if limit_bytes is not None else available_bytes(device)
    if have is None or estimate.total <= have:
        return
    where = "--memory-limit-bytes" if limit_bytes is not None else f"{device} has available"
    raise InsufficientMemory(
        f"stage {stage_index} needs about {estimate.describe()} on {device}, but {where} only {gib(have)}: "
        f"lower --graph-cache-bytes, --input-cache-bytes or --held-gradient-bytes, use another --device "
        f"(or free this one), or run the model in more stages"
    )
