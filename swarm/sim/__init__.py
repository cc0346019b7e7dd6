"""Discrete-event simulator of a swarm: thousands of peers, churn, the real routing and
rebalancing policies. Pure code: simulated time only, randomness from the config's seed.

``simulate(SimConfig(...)) -> SimResult``; ``main(argv)`` is the ``swarm simulate`` command.
"""

from swarm.sim.config import Preemption, SimConfig
from swarm.sim.engine import simulate
from swarm.sim.main import main
from swarm.sim.result import Move, SimResult, format_table

__all__ = ["Move", "Preemption", "SimConfig", "SimResult", "format_table", "main", "simulate"]
