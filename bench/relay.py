"""Tokens/s through swarm's relay vs direct, on emulated links, and the latency one relay adds to a call.

Run from the repository root as root:  .venv/bin/python bench/relay.py [--rates 20,100] [--repeat 1]
Prints markdown tables and writes them, with the environment, to bench/results/relay.md.

Topology (deploy/netns/): 5 emulated hosts on one bridge: a bootstrap DHT node, a public stage-0 peer (which is
also the relay), a public stage-1 peer, a stage-1 peer behind a NAT router of its own, and a public trainer. Each
mode runs its own stage-1 peer with the same stage-0 peer and trainer flags: ``direct`` the public one, ``relayed``
the one behind NAT, which takes an endpoint on the stage-0 peer (swarm.transport.relay). Relayed, every byte to and
from stage 1 crosses the relay's link twice (in from the caller, out to the NATed peer) on top of its own
stage-0 traffic: that is what a relay costs, and the tokens/s ratio says how much at each rate.

Protocol: for each mode (alternating order with ``--repeat``), the stage-1 peer and the trainer start, and for each
rate (slowest first, as in bench/netswarm.py) every host's link is set to it and tokens/s is measured between two
step boundaries of the trainer's metrics (bench/netswarm.py's window). Then the trainer stops, the links are
unlimited, and a probe on the trainer's host times ``Info`` calls to the stage-1 peer's announced endpoint (the
relay's, for the NATed one): the median round trip on an open channel, and a fresh channel's first call (TCP,
TLS handshake through the splices, call). Relayed minus direct is the relay's added latency per hop.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402
from netswarm import (  # noqa: E402
    IN_FLIGHT,
    LR,
    MAX_DATA_BYTES,
    MICROBATCH,
    TARGET_BATCH,
    _parse_rates,
    _rate_label,
    _wait_progress,
    measure_window,
)

from deploy.netns import EmulatedNetwork, have_netns  # noqa: E402
from swarm.coordinator.launcher import ProcessGroup  # noqa: E402
from swarm.coordinator.localswarm import (  # noqa: E402
    Where,
    start_bootstrap,
    start_peer,
    start_trainer,
    wait_ready,
)

MODES = ("direct", "relayed")
RUN_FLAGS = [
    "--preset",
    "tiny",
    "--codec",
    "int8",
    "--target-batch-size",
    str(TARGET_BATCH),
    "--lr",
    str(LR),
    "--no-rebalance",
]
RUN_ID = "relaybench"
PROBE_CALLS = 200  # Info round trips timed on one open channel
PROBE_FRESH = 20  # fresh channels, each timed to the end of its first call
# Times Info calls to the endpoint argv[1] (trust on first use: a tool's probe of a peer this bench started).
_PROBE = """
import asyncio, json, statistics, sys, time
from swarm.transport.client import PeerClient
from swarm.transport.security import address_by_handshake

async def main(endpoint, calls, fresh):
    address = address_by_handshake(endpoint)
    firsts = []
    for _ in range(fresh):
        start = time.perf_counter()
        client = PeerClient(address)
        await client.info('%s', timeout_s=10)
        firsts.append(time.perf_counter() - start)
        await client.close()
    client = PeerClient(address)
    for _ in range(5):
        await client.info('%s', timeout_s=10)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        await client.info('%s', timeout_s=10)
        times.append(time.perf_counter() - start)
    await client.close()
    print(json.dumps({"call_ms": statistics.median(times) * 1e3, "fresh_ms": statistics.median(firsts) * 1e3}))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
""" % ((RUN_ID,) * 3)


def _probe(host, endpoint: str) -> dict[str, float]:
    import json

    out = host.run(
        [sys.executable, "-c", _PROBE, endpoint, str(PROBE_CALLS), str(PROBE_FRESH)],
        timeout_s=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_mode(
    mode: str, net, group, addr_file: Path, workdir: Path, rates, args
) -> tuple[dict, dict[str, float]]:
    """Tokens/s windows of ``mode`` by rate, and its probe's latencies (unlimited links)."""
    boot, relay, public1, natted, trainer_host = net.hosts
    for host in net.hosts:
        host.set_rate(rates[0])
    host = public1 if mode == "direct" else natted
    peer = start_peer(
        group,
        f"s1-{mode}",
        stage=1,
        run_id=RUN_ID,
        addr_file=addr_file,
        where=Where.on(host),
        run_flags=RUN_FLAGS,
    )
    endpoint = wait_ready(peer)
    if mode == "relayed":
        endpoint = peer.wait_for(
            r"relay \w+ lends this peer the endpoint (\S+)", timeout_s=60
        ).group(1)
    metrics = workdir / f"metrics-{mode}.jsonl"
    trainer = start_trainer(
        group,
        f"trainer-{mode}",
        run_id=RUN_ID,
        addr_file=addr_file,
        metrics_path=metrics,
        steps=0,
        where=Where.on(trainer_host),
        microbatch_size=MICROBATCH,
        in_flight=IN_FLIGHT,
        eval_every_steps=0,
        eval_batches=1,
        log_every_s=10,
        max_bytes=MAX_DATA_BYTES,
    )
    _wait_progress(metrics, after_step=0, trainer=trainer, timeout_s=args.timeout)
    windows = {}
    names = ("boot", "relay/s0", "s1-public", "s1-natted", "trainer")
    for rate in rates:
        for h in net.hosts:
            h.set_rate(rate)
        window = measure_window(
            dict(zip(names, net.hosts)),
            metrics,
            trainer,
            rate_mbit=rate,
            warmup_s=args.warmup_seconds,
            seconds=args.seconds,
            min_steps=args.min_steps,
            timeout_s=args.timeout,
        )
        windows[rate] = window
        print(
            f"  {mode} @ {_rate_label(rate)}: {window.tokens_per_s:,.0f} tokens/s over {window.seconds:.0f}s "
            f"({window.steps} steps); relay link up/down {window.links['relay/s0'][0]:.1f}/"
            f"{window.links['relay/s0'][1]:.1f} Mbit/s; load {window.load:.1f}",
            flush=True,
        )
    group.stop(trainer.name, sig=signal.SIGINT, timeout_s=30)
    for h in net.hosts:
        h.set_rate(None)
    latency = _probe(trainer_host, endpoint)
    print(
        f"  {mode}: Info {latency['call_ms']:.2f} ms, fresh channel {latency['fresh_ms']:.1f} ms",
        flush=True,
    )
    group.stop(peer.name, timeout_s=60)
    return windows, latency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rates", default="20,100", help="Mbit/s per link, slowest first (0 = unlimited)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each mode, alternating the order"
    )
    parser.add_argument("--warmup-seconds", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--min-steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "relay.md")
    args = parser.parse_args()
    ok, why = have_netns()
    if not ok:
        raise SystemExit(f"bench/relay.py needs network namespaces: {why}")
    rates = _parse_rates(args.rates)
    info = RunInfo(
        command="sudo .venv/bin/python bench/relay.py" + "".join(f" {a}" for a in sys.argv[1:])
    )
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="swarm-relaybench-"))
    print(f"logs in {workdir}", flush=True)
    results: dict[str, list] = {mode: [] for mode in MODES}
    with EmulatedNetwork(num_hosts=5, nat_hosts=(3,)) as net, ProcessGroup(workdir) as group:
        boot, relay = net.hosts[:2]
        addr_file = workdir / "bootstrap.addr"
        start_bootstrap(group, addr_file, where=Where.on(boot))
        # the stage-0 peer publishes the run (netswarm's tiny int8 run: batch and learning rate)
        s0 = start_peer(
            group,
            "s0-relay",
            stage=0,
            run_id=RUN_ID,
            addr_file=addr_file,
            where=Where.on(relay),
            run_flags=RUN_FLAGS,
        )
        wait_ready(s0)
        started = time.monotonic()
        for r in range(args.repeat):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                results[mode].append(
                    measure_mode(mode, net, group, addr_file, workdir, rates, args)
                )
        print(f"  measured in {time.monotonic() - started:.0f}s", flush=True)
    info.finish()
    body = report(results, rates)
    path = write_result(
        args.out,
        title="Tokens/s through a relay vs direct, and a relay's latency",
        info=info,
        body=body,
    )
    print("\n" + body + f"\n\nwritten to {path}")


def report(results: dict[str, list], rates) -> str:
    def median_tps(mode, rate):
        return statistics.median(w[rate].tokens_per_s for w, _ in results[mode])

    def median_lat(mode, key):
        return statistics.median(lat[key] for _, lat in results[mode])

    rows = []
    for rate in rates:
        direct, relayed = median_tps("direct", rate), median_tps("relayed", rate)
        relay_link = max(max(w[rate].links["relay/s0"]) for w, _ in results["relayed"])
        rows.append(
            [
                _rate_label(rate),
                f"{direct:,.0f}",
                f"{relayed:,.0f}",
                f"{relayed / direct:.2f}",
                f"{relay_link:.1f}",
            ]
        )
    throughput = markdown_table(
        [
            "link (each host)",
            "direct tokens/s",
            "relayed tokens/s",
            "relayed / direct",
            "relay's busier direction, Mbit/s (relayed)",
        ],
        rows,
    )
    lat_rows = [
        [
            what,
            f"{median_lat('direct', key):.2f}",
            f"{median_lat('relayed', key):.2f}",
            f"{median_lat('relayed', key) - median_lat('direct', key):+.2f}",
        ]
        for what, key in (
            ("Info round trip, open channel", "call_ms"),
            ("fresh channel: connect + TLS + first Info", "fresh_ms"),
        )
    ]
    latency = markdown_table(
        ["unlimited links, ms (median)", "direct", "relayed", "added by the relay"], lat_rows
    )
    runs = len(results["direct"])
    return "\n".join(
        [
            f"the tiny preset (the demo's), int8 codec, 2 stages, microbatch {MICROBATCH}, {IN_FLIGHT} in flight; "
            f"{runs} run(s) of each mode, medians.",
            "",
            throughput,
            "",
            latency,
        ]
    )


if __name__ == "__main__":
    main()
