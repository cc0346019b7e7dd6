"""Routing policy: which peer of each pipeline stage serves a request.

Pure code (no I/O, clocks or asyncio) shared by the trainer and the simulator. Start with
:class:`Router`; see its docstring for the exact choice rule.
"""

from swarm.routing.budget import RetryBudget
from swarm.routing.config import RoutingConfig
from swarm.routing.errors import NoPeersAvailable, RetriesExhausted, RoutingError
from swarm.routing.retry import Failure, StageRequest, wake_at
from swarm.routing.router import Router
from swarm.routing.stats import PeerSnapshot

__all__ = [
    "Failure",
    "NoPeersAvailable",
    "PeerSnapshot",
    "RetriesExhausted",
    "RetryBudget",
    "Router",
    "RoutingConfig",
    "RoutingError",
    "StageRequest",
    "wake_at",
]
