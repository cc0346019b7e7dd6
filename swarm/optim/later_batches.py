"""Gradient sums that arrive ahead of the stage's optimizer step, kept until the stage gets there."""

from __future__ import annotations

import torch


class LaterBatches:
    """Gradient sums of microbatches that belong to a later optimizer step than the stage's current one,
    kept aside until the stage gets there (the trainer streams the next batch while the stage still waits
    for the last microbatches of this one). Steps more than ``max_ahead`` ahead are kept with the step
    ``max_ahead`` ahead, so memory stays at ``max_ahead`` gradient copies whatever the callers send."""

    def __init__(self, max_ahead: int = 4):
        self.max_ahead = max_ahead
        self._by_step: dict[int, tuple[list[torch.Tensor | None], int]] = {}

    def add(
        self, step: int, current: int, grads: list[torch.Tensor | None], num_samples: int
    ) -> None:
        step = min(step, current + self.max_ahead)
        held = self._by_step.get(step)
        if held is None:
            self._by_step[step] = (
                [None if g is None else g.detach().clone() for g in grads],
                num_samples,
            )
            return
        sums, n = held
        for i, g in enumerate(grads):
            if g is not None:
                sums[i] = g.detach().clone() if sums[i] is None else sums[i].add_(g)
        self._by_step[step] = (sums, n + num_samples)

    @property
    def samples(self) -> int:
        """Samples of the batches kept."""
        return sum(n for _, n in self._by_step.values())

    def clear(self) -> int:
        """Drop every batch kept; how many samples they held."""
        samples = self.samples
        self._by_step.clear()
        return samples

    def pop_due(self, current: int) -> tuple[int, list[torch.Tensor | None], int] | None:
        """The oldest batch kept for a step the stage has reached, if any: (its step, its sums, its samples). Its step
        is before ``current`` when the stage went past it without this replica (it loaded its peers' state)."""
        due = [step for step in self._by_step if step <= current]
        if not due:
            return None
        step = min(due)
        return (step, *self._by_step.pop(step))
