"""``swarm simulate``: run the simulator from the command line and print a table.

Flags are built from :class:`~swarm.sim.config.SimConfig` (and its nested routing and rebalancing
configs); ``--preempt TIME_S:STAGE:FRACTION`` may be repeated; ``--compare`` runs the same swarm
with and without rebalancing side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from swarm.argconfig import add_config_args, config_from_args
from swarm.sim.config import Preemption, SimConfig
from swarm.sim.engine import simulate
from swarm.sim.result import SimResult, format_table

__all__ = ["build_parser", "config_from_argv", "main", "run"]

# Tuple fields arrive from argparse as strings; the element type of each.
_TUPLE_TYPES = {"initial_peers_per_stage": int, "peer_speeds": float, "stage_costs": float}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The simulator's flags, added to ``parser`` (e.g. a ``swarm simulate`` subparser) or a new one."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="swarm simulate", description=__doc__.splitlines()[0])
    add_config_args(parser, SimConfig, skip={"preemptions"})
    parser.add_argument(
        "--preempt",
        action="append",
        default=[],
        type=Preemption.parse,
        metavar="TIME_S:STAGE:FRACTION",
        help="kill a fraction of a stage's peers at a time",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run twice, with and without rebalancing, and print both",
    )
    parser.add_argument("--table-every-s", type=float, default=60.0, help="seconds per table row")
    return parser


def config_from_argv(args: argparse.Namespace) -> SimConfig:
    """A :class:`SimConfig` from parsed flags (``ValueError`` with the numbers when they clash)."""
    overrides = {"preemptions": tuple(args.preempt)}
    for name, kind in _TUPLE_TYPES.items():
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = tuple(kind(v) for v in value)
    return config_from_args(SimConfig, args, **overrides)


def summary(name: str, result: SimResult) -> str:
    return (
        f"{name}: mean {result.mean_throughput():.1f} samples/s, {result.num_moves} moves, "
        f"{result.microbatches_completed} microbatches done, {result.microbatches_in_flight} in flight, "
        f"{result.hop_failures} failed requests retried, {result.recomputes} recomputes, "
        f"{result.peers_arrived} arrived, {result.peers_died} died, {result.events} events"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, simulate, print a markdown table and a summary; returns the exit status."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Simulate what parsed flags describe (``swarm simulate`` calls this)."""
    try:
        config = config_from_argv(args)
    except ValueError as error:
        print(f"swarm simulate: {error}", file=sys.stderr)
        return 2
    runs = {"rebalancing" if config.rebalance else "static": config}
    if args.compare:
        runs = {
            "rebalancing": dataclasses.replace(config, rebalance=True),
            "static": dataclasses.replace(config, rebalance=False),
        }
    results = {name: simulate(run) for name, run in runs.items()}
    print(format_table(results, args.table_every_s))
    for name, result in results.items():
        print(summary(name, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
