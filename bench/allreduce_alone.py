"""One hivemind all-reduce of a stage's gradient size between two averagers on this machine, nothing else running:
the floor under a step's all-reduce in the swarm (bench/results/convergence.md compares it with the all-reduce
inside a lockstep run).

    .venv/bin/python bench/allreduce_alone.py [--values 420000] [--rounds 8] [--exact]

``--exact`` installs swarm's reducer (float64 deltas, replicas end bit-identical), as the peers run it. Prints the
wall time of each round (matchmaking and all-reduce) as both averagers see it.
"""

from __future__ import annotations

import argparse
import threading
import time

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--values", type=int, default=420_000, help="float32 values averaged (tiny's stage: ~420k)"
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--exact", action="store_true", help="swarm's exact reducer, as the peers run it"
    )
    args = parser.parse_args()
    if args.exact:
        import swarm.averaging.hivemind_private  # noqa: F401 (installs the reducer before the averagers fork)

    first = hivemind.DHT(start=True)
    second = hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs())
    averagers = [
        DecentralizedAverager(
            [torch.randn(args.values)],
            dht=dht,
            prefix="allreduce_alone",
            target_group_size=2,
            min_matchmaking_time=0.3,
            request_timeout=0.2,
            start=True,
        )
        for dht in (first, second)
    ]
    try:
        for round_ in range(args.rounds):
            took = [0.0, 0.0]

            def one(i: int, took: list[float]) -> None:
                start = time.perf_counter()
                averagers[i].step(timeout=30)
                took[i] = time.perf_counter() - start

            threads = [threading.Thread(target=one, args=(i, took)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            print(f"round {round_}: {took[0] * 1000:.0f} ms / {took[1] * 1000:.0f} ms", flush=True)
    finally:
        for averager in averagers:
            averager.shutdown()
        first.shutdown()
        second.shutdown()


if __name__ == "__main__":
    main()
