"""One rule for "far larger than usual", shared by the peer (the parameter gradients it is made to compute) and
the trainer (the input gradients peers send back): a value more than ``max_ratio`` times the lower quartile of the
last ``window`` accepted ones is an outlier. The lower quartile, not the mean or the median: a source sending huge
values from the start makes up to three quarters of the history without moving the reference."""

from __future__ import annotations

import math
import statistics
from collections import deque

WINDOW, MIN = 64, 8  # values remembered; values needed before anything is judged


class OutlierBound:
    def __init__(self, max_ratio: float, *, window: int = WINDOW, min_count: int = MIN):
        self.max_ratio = max_ratio  # 0 = no bound
        self.min_count = min_count
        self._history: deque[float] = deque(maxlen=window)

    @property
    def active(self) -> bool:
        """Whether there is a bound at all (callers skip measuring when not: it is on their hot path)."""
        return self.max_ratio > 0

    def excess(self, value: float) -> str | None:
        """Why ``value`` is an outlier (a sentence's end), or None (then it is remembered as accepted)."""
        if not math.isfinite(value):
            return f"is {value}, not finite"
        history = self._history
        if self.max_ratio and len(history) >= self.min_count:
            reference = statistics.quantiles(history, n=4)[0]
            if value > self.max_ratio * reference:
                return (
                    f"is {value:.3g}, {value / max(reference, 1e-30):.3g}x the lower quartile of the last "
                    f"{len(history)} ({reference:.3g}; the bound is {self.max_ratio:g}x)"
                )
        history.append(value)
        return None
