"""The parameters of a replica's recent optimizer steps, so that work begun on one step's parameters ends on them.

A replica's optimizer updates its parameters in place. An autograd graph a forward kept saved those very tensors,
so before, every step dropped the kept graphs and their backward computed the forward again on the new
parameters (gradients of other parameters than the forward's, and about a third of a stage's compute spent
twice). Here every training forward runs on a *version*: a copy of the parameters at one optimizer step, made
once when the replica reaches that step. The optimizer's in-place update never touches a version, so a graph
kept across a step stays valid, and its backward gives the gradient of the parameters its forward used.

A trainer that streams the next global batch while the stages average the last one pins each microbatch to the
parameters of one step (``params_step`` in its calls): the batch of step t computes on step t - d's parameters for
a fixed delay d, whichever step each replica has reached by the time a call arrives. The math is then fixed by
the schedule, not by timing, and ``swarm.trainer.reference`` trains the same schedule in one process.

Memory: the live parameters plus one copy for the current step and one per older step kept (``keep``); a version
also lives as long as a graph or cached input of it does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Version:
    """The parameters of ``stage_module`` at optimizer step ``step`` (detached copies; each requires grad as
    its parameter does), keyed as :class:`_Method` takes them."""

    step: int
    params: dict[str, torch.Tensor]
    trainable: list[
        torch.Tensor
    ]  # the copies of the parameters that require grad, in parameters() order
    digest: str = field(default="")  # swarm.model.state_digest at that step, once hashed

    @property
    def storage_ids(self) -> set[int]:
        """Where the parameters' data lies: tensors autograd saves from these are not a graph's own memory."""
        return {t.untyped_storage().data_ptr() for t in self.params.values()}

    def call(self, module: nn.Module, method: str, *args):
        """``module.<method>(*args)`` computed with this version's parameters (buffers are the module's)."""
        return torch.func.functional_call(_Method(module), self.params, (method, *args))


class _Method(nn.Module):
    """Calls a method of the wrapped module by name: ``torch.func.functional_call`` only calls ``forward``, and a
    stage's loss is another method."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.stage = module

    def forward(self, method: str, *args):
        return getattr(self.stage, method)(*args)


class ParamVersions:
    """The versions of ``stage_module``'s parameters a replica holds: the current step's, and up to ``keep``
    older ones. Runs on the peer's compute thread, like everything that touches the parameters."""

    def __init__(self, stage_module: nn.Module, step: int, *, keep: int = 1):
        if keep < 0:
            raise ValueError(f"keep counts older versions held and must be >= 0, got {keep}")
        self.stage_module, self.keep = stage_module, keep
        self._versions: dict[int, Version] = {}
        # calls pinned to a step this replica did not hold (see pick), since the start
        self.missed = 0
        self.changed(step)

    @property
    def current(self) -> Version:
        return self._versions[max(self._versions)]

    @property
    def steps(self) -> list[int]:
        return sorted(self._versions)

    def changed(self, step: int) -> None:
        """The live parameters changed (an optimizer step to ``step``, or a state loaded at ``step``): copy them as
        the version of ``step``. An older version stays if it is of one of the ``keep`` steps just before
        ``step``; a loaded state replaces a version of the same step and anything newer."""
        self._versions = {s: v for s, v in self._versions.items() if step - self.keep <= s < step}
        trainable, params = [], {}
        for name, p in self.stage_module.named_parameters():
            copy = p.detach().clone().requires_grad_(p.requires_grad)
            params[f"stage.{name}"] = copy
            if p.requires_grad:
                trainable.append(copy)
        self._versions[step] = Version(step, params, trainable)

    def get(self, step: int) -> Version | None:
        return self._versions.get(step)

    def resolve(self, step: int | None) -> Version:
        """The version a call pinned to ``step`` runs on: that step's, else the nearest held (the newer of two
        as near); None: the current one."""
        if step is None:
            return self.current
        held = self._versions.get(step)
        if held is not None:
            return held
        return self._versions[min(self._versions, key=lambda s: (abs(s - step), -s))]

    def pick(self, step: int | None) -> Version:
        """:meth:`resolve` for a call about to compute. A step this replica does not hold (it loaded a newer state,
        or it is behind: the trainer waits for every replica to reach a step before it pins calls to it, so
        neither is the rule) is counted in ``missed``, and the call still serves, off the schedule by a step."""
        version = self.resolve(step)
        if step is not None and version.step != step:
            self.missed += 1
            logger.warning(
                "a call asked for the parameters of step %d; this replica holds steps %s: computing with "
                "step %d's",
                step,
                self.steps,
                version.step,
            )
        return version
