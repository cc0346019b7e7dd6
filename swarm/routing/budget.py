"""The retry budget of one stage request: a finite number of attempts, and the peers that failed it.

:class:`~swarm.routing.retry.StageRequest` drives it for the trainer and the simulator; the router hands one
out per request (:meth:`~swarm.routing.router.Router.retry_budget`) with its configured ``max_attempts``.
"""

from __future__ import annotations

from swarm.routing.errors import RetriesExhausted

__all__ = ["RetryBudget"]


class RetryBudget:
    """Counts the attempts of one request to ``stage``; at most ``max_attempts`` (>= 1) fail."""

    def __init__(self, stage: int, *, max_attempts: int) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.stage = stage
        self.max_attempts = max_attempts
        self._failed: list[str] = []
        self._last_error: BaseException | None = None

    @property
    def attempts_failed(self) -> int:
        return len(self._failed)

    @property
    def attempts_left(self) -> int:
        return self.max_attempts - len(self._failed)

    @property
    def failed_peers(self) -> frozenset[str]:
        """Peers that failed this request: pass as ``exclude`` to ``Router.choose``."""
        return frozenset(self._failed)

    @property
    def last_error(self) -> BaseException | None:
        return self._last_error

    def record_failure(self, peer_id: str, error: BaseException | None = None) -> None:
        """Record that the attempt on ``peer_id`` failed with ``error``.

        Raises :class:`RetriesExhausted` (chained from ``error``) when that was the last attempt
        the budget allows; otherwise returns and the caller may try another peer.
        """
        self._failed.append(peer_id)
        if error is not None:
            self._last_error = error
        if len(self._failed) >= self.max_attempts:
            raise RetriesExhausted(
                self.stage, len(self._failed), self._last_error
            ) from self._last_error
