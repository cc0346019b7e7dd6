"""Routing policy: which peer of each pipeline stage serves a request.

Pure code (no I/O, clocks or asyncio) shared by the trainer and the simulator. Start with
:class:`Router`; see its docstring for the exact choice rule.
"""

from swarm.routing.config import RoutingConfig
from swarm.routing.errors import NoPeersAvailable, RetriesExhausted, RoutingError
from swarm.routing.retry import Failure, RetryBudget, StageRequest, wake_at
from swarm.routing.router import Router
from swarm.routing.stats import PeerState

__all__ = [
    "Failure",
    "NoPeersAvailable",
    "PeerState",
    "RetriesExhausted",
    "RetryBudget",
    "Router",
    "RoutingConfig",
    "RoutingError",
    "StageRequest",
    "wake_at",
]
