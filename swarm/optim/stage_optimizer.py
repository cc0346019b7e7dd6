"""One stage's optimizer as the executor sees it: accumulate gradient sums toward a global batch, then step.

Two implementations share one small interface (:class:`StageOptimizer`), so the executor does not care
which it has:

* :class:`LocalStageOptimizer` steps alone when this replica has seen ``target_batch_size`` samples (an
  executor built outside a peer: unit tests, tools, and each stage of the single-process reference).
* ``swarm.averaging.HivemindStageOptimizer`` makes every peer of a stage accumulate toward one global batch,
  all-reduce their gradients and step together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from swarm.config import RunConfig
from swarm.model import Stage
from swarm.optim.adamw import build_stage_optimizer
from swarm.optim.schedule import set_learning_rate


class StageOptimizer(Protocol):
    """What the executor needs. ``accumulate`` takes gradient SUMS over ``num_samples`` samples (one
    microbatch) in ``stage_module.parameters()`` order, toward optimizer step ``batch_step`` (None: the current
    one), and returns True when the stage's step ended (the parameters changed, or may have: a step whose
    averaged gradient is not finite is skipped, yet its global batch is used up and ``step`` counts it, so
    every replica and the schedule stay on the same step). ``step`` counts the optimizer steps taken (the
    index of the step the next global batch is for); ``maybe_step`` takes the next one if it is due."""

    step: int
    local_samples: int
    # samples counted here that reached no optimizer step of the stage (a replica that missed its all-reduce)
    samples_left_out: int
    # its last steps, each with the replicas whose gradients it averaged, where it knows them (InfoResponse)
    averaged_steps: Sequence[tuple[int, tuple[str, ...]]]
    # seconds a step typically holds the compute thread beyond the update itself
    step_pause_s: float
    # whether the step check should look again soon rather than at its period (a closed batch's group forming)
    check_soon: bool

    def accumulate(
        self, grads: list[torch.Tensor | None], num_samples: int, batch_step: int | None = None
    ) -> bool: ...
    def maybe_step(self) -> bool: ...
    def close_batch(
        self, batch_step: int, replicas: int = 0, group=None, *, stage_step: int = 0
    ) -> None: ...
    def retry_round(self, batch_step: int) -> int: ...
    def grad_sums(self) -> list[torch.Tensor]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def shutdown(self) -> None: ...


class LocalStageOptimizer:
    """Steps alone whenever this replica has accumulated ``target_batch_size`` samples. It counts every
    sample toward its own next step (``batch_step`` is ignored): with no peers to agree with, the count
    alone is exact."""

    def __init__(self, stage_module: Stage, run: RunConfig):
        self.stage_module, self.run = stage_module, run
        self.params = list(stage_module.parameters())
        self.optimizer = build_stage_optimizer(stage_module, run)
        self.step = 0
        self.local_samples = 0
        self.samples_left_out = 0  # every sample counted goes into its own next step
        self.averaged_steps = ()  # no peers: nobody asks whose gradients its steps hold
        self.step_pause_s = 0.0  # no all-reduce
        self.check_soon = False  # it steps inside accumulate
        self._sums = [torch.zeros_like(p) for p in self.params]

    def accumulate(self, grads, num_samples, batch_step=None):
        for acc, g in zip(self._sums, grads):
            if g is not None:
                acc.add_(g)
        self.local_samples += num_samples
        return self.maybe_step()

    def close_batch(
        self, batch_step: int, replicas: int = 0, group=None, *, stage_step: int = 0
    ) -> None:
        """Nothing to do: this replica steps on its own count, whoever sent the samples."""

    def retry_round(self, batch_step: int) -> int:
        return 0  # no all-reduce to fail

    def maybe_step(self) -> bool:
        if self.local_samples < self.run.target_batch_size:
            return False
        for p, acc in zip(self.params, self._sums):
            p.grad = acc / self.local_samples  # the mean gradient over the global batch
        set_learning_rate(self.optimizer, self.run, self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for acc in self._sums:
            acc.zero_()
        self.local_samples = 0
        self.step += 1
        return True

    def grad_sums(self):
        return [acc.clone() for acc in self._sums]

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = saved_step(state)

    def shutdown(self) -> None:
        pass


def saved_step(state: dict) -> int:
    """The optimizer step a :meth:`StageOptimizer.state_dict` holds. Checkpoints of version 0.1.0 name it
    "epoch": they keep loading."""
    return int(state["step"] if "step" in state else state["epoch"])
