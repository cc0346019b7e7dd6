"""Errors raised by the routing policy.

Both are :class:`~swarm.errors.SwarmError`s (and ``RuntimeError``s) about the state of the swarm, not about
the caller's arguments (those raise ``ValueError``). Each message names the stage, says why, and says what to
do. They stay in the trainer's process: no peer sends them.
"""

from __future__ import annotations

import grpc

from swarm.errors import SwarmError

__all__ = ["RoutingError", "NoPeersAvailable", "RetriesExhausted"]


class RoutingError(SwarmError, RuntimeError):
    """Base class: routing could not produce a peer for a stage request. Routing already tried the peers it
    could, so the caller should not retry elsewhere on its own."""

    code = grpc.StatusCode.UNAVAILABLE
    retry_elsewhere = False

    def __init__(self, stage: int, message: str) -> None:
        super().__init__(message)
        self.stage = stage


class NoPeersAvailable(RoutingError):
    """No peer of ``stage`` may be chosen right now.

    Attributes say why, so a caller can decide between waiting and giving up:
    ``num_known`` peers are announced for the stage, ``num_banned`` of them are banned (the
    earliest ban ends at ``retry_at_s``, ``None`` when none is banned) and ``num_excluded`` were
    excluded by the caller (they already failed this request).
    """

    def __init__(
        self,
        stage: int,
        *,
        num_known: int,
        num_banned: int = 0,
        num_excluded: int = 0,
        retry_at_s: float | None = None,
    ) -> None:
        self.num_known = num_known
        self.num_banned = num_banned
        self.num_excluded = num_excluded
        self.retry_at_s = retry_at_s
        super().__init__(stage, self._describe(stage))

    def _describe(self, stage: int) -> str:
        if self.num_known == 0:
            return (
                f"no peer serves stage {stage}: none is announced in discovery; start a peer for "
                f"stage {stage} (`swarm peer --stage {stage} ...`) or check that this process "
                "reaches the DHT"
            )
        if self.num_banned == self.num_known:
            return (
                f"all {self.num_known} peer(s) of stage {stage} are banned after failures, the "
                f"first until t={self.retry_at_s:.3f}s; wait until then, or check why those peers "
                "fail (their logs, the network) and add healthy peers"
            )
        if self.num_excluded == self.num_known:
            return (
                f"all {self.num_known} peer(s) of stage {stage} were excluded because they already "
                "failed this request; retry it without exclusions later or add peers to the stage"
            )
        until = ""
        if self.retry_at_s is not None:
            until = f", the first ban ends at t={self.retry_at_s:.3f}s"
        return (
            f"no eligible peer for stage {stage}: of {self.num_known} announced, "
            f"{self.num_banned} are banned{until} and {self.num_excluded} already failed this "
            "request; wait for a ban to end or add peers to the stage"
        )


class RetriesExhausted(RoutingError):
    """A stage request failed on every attempt its :class:`~swarm.routing.retry.RetryBudget` allows.

    ``attempts`` is how many were made, ``last_error`` the error of the final one (also chained as
    ``__cause__`` by the budget).
    """

    def __init__(self, stage: int, attempts: int, last_error: BaseException | None) -> None:
        self.attempts = attempts
        self.last_error = last_error
        last = "none recorded"
        if last_error is not None:
            last = f"{type(last_error).__name__}: {last_error}"
        super().__init__(
            stage,
            f"stage {stage} request failed after {attempts} attempt(s) (last error: {last}); "
            f"check the health of stage {stage}'s peers, add peers, or raise "
            "RoutingConfig.max_attempts (`swarm train --max-attempts`)",
        )
