"""``python -m deploy.netns selftest|cleanup``: check the harness on this machine, or remove leftovers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deploy.netns.commands import cleanup_stale, have_netns
from deploy.netns.measure import measure_tcp_throughput
from deploy.netns.network import EmulatedNetwork


def _selftest(rate_mbit: float | None, seconds: float) -> int:
    ok, why = have_netns()
    if not ok:
        print(f"selftest impossible: {why}", file=sys.stderr)
        return 2
    with EmulatedNetwork(num_hosts=2, rate_mbit=rate_mbit) as net:
        a, b = net.hosts
        print(
            f"hosts {a.address} ({a.namespace}) and {b.address} ({b.namespace}), "
            f"limit {rate_mbit if rate_mbit is not None else 'unlimited'} Mbit/s each way"
        )
        for src, dst in ((a, b), (b, a)):
            res = measure_tcp_throughput(src, dst, duration_s=seconds)
            print(
                f"{src.address} -> {dst.address}: {res.mbit_per_s:.1f} Mbit/s of TCP payload "
                f"({res.bytes_received} bytes in {res.duration_s:.2f} s)"
            )
    print("torn down")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.netns", description="Emulated slow links on one machine."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("selftest", help="two hosts, measure TCP throughput both ways, tear down")
    p.add_argument("--rate-mbit", type=float, default=20.0, help="per-host limit; 0 = unlimited")
    p.add_argument("--seconds", type=float, default=3.0, help="duration of each measurement")
    p = sub.add_parser("cleanup", help="remove namespaces/links left by crashed runs")
    p.add_argument("--prefix", default="sw")
    args = parser.parse_args(argv)
    if args.cmd == "selftest":
        return _selftest(args.rate_mbit or None, args.seconds)
    print("\n".join(cleanup_stale(args.prefix)) or "nothing stale")
    return 0


if __name__ == "__main__":
    sys.exit(main())
