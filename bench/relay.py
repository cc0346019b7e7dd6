"""Tokens/s through swarm's relay vs direct, on emulated links, and the latency one relay adds to a call.

Run from the repository root as root:  .venv/bin/python bench/relay.py [--rates 20,100]
Prints markdown tables and writes them, with the environment, to bench/results/relay.md.

Topology (deploy/netns/): 7 emulated hosts on one bridge running two swarms at once, one per mode, so that both
see the same machine load (on a shared 2-core machine the load drifts by 2-3x within minutes, far more than the
effect measured). Each swarm has a stage-0 peer, a stage-1 peer and a trainer on hosts of their own, with the same
flags and run config (tiny preset, int8, run ids relaybench-direct and relaybench-relayed), and one bootstrap node
serves both. ``direct``: the stage-1 peer is public. ``relayed``: the stage-1 peer sits behind a NAT router of its
own and takes an endpoint on its run's stage-0 peer (swarm.transport.relay): every byte to and from stage 1 then
crosses the relay's link twice (in from the trainer, out to the NATed peer) on top of the relay's own stage-0
traffic. That is what a relay costs, and the tokens/s ratio says how much at each rate.

Protocol: for each rate (slowest first, as in bench/netswarm.py) every host's link is set to it and tokens/s of both
trainers is measured over the same period (bench/netswarm.py's window, both at once). Then the trainers stop, the
links are unlimited, and a probe on each trainer's host times ``Info`` calls to its stage-1 peer's announced
endpoint (the relay's, for the NATed one), alternating the modes twice: the median round trip on an open channel,
and a fresh channel's first call (TCP, TLS handshake through the splices, call). Relayed minus direct is the
relay's added latency per hop.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402
from netswarm import (  # noqa: E402
    IN_FLIGHT,
    LR,
    MICROBATCH,
    TARGET_BATCH,
    _parse_rates,
    _rate_label,
    _wait_progress,
    measure_window,
    start_bench_trainer,
)

from deploy.netns import EmulatedNetwork, have_netns  # noqa: E402
from swarm.coordinator.launcher import ProcessGroup  # noqa: E402
from swarm.coordinator.localswarm import (  # noqa: E402
    Where,
    start_bootstrap,
    start_peer,
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
RUN_PREFIX = "relaybench"
PROBE_CALLS = 200  # Info round trips timed on one open channel
PROBE_FRESH = 20  # fresh channels, each timed to the end of its first call
# Times Info calls to the endpoint argv[1] (trust on first use: a tool's probe of a peer this bench started).
_PROBE = """
import asyncio, json, statistics, sys, time
from swarm.transport.client import PeerClient
from swarm.transport.security import address_by_handshake

async def main(endpoint, run_id, calls, fresh):
    address = address_by_handshake(endpoint)
    firsts = []
    for _ in range(fresh):
        start = time.perf_counter()
        client = PeerClient(address)
        await client.info(run_id, timeout_s=10)
        firsts.append(time.perf_counter() - start)
        await client.close()
    client = PeerClient(address)
    for _ in range(5):
        await client.info(run_id, timeout_s=10)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        await client.info(run_id, timeout_s=10)
        times.append(time.perf_counter() - start)
    await client.close()
    print(json.dumps({"call_ms": statistics.median(times) * 1e3, "fresh_ms": statistics.median(firsts) * 1e3}))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


def _probe(host, endpoint: str, run_id: str) -> dict[str, float]:
    import json

    out = host.run(
        [sys.executable, "-c", _PROBE, endpoint, run_id, str(PROBE_CALLS), str(PROBE_FRESH)],
        timeout_s=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_mode(
    mode: str, hosts: dict, group, addr_file: Path, workdir: Path, timeout_s: float
) -> dict:
    """Start ``mode``'s swarm (its stage-0 peer publishes the run) and trainer; what measuring it needs."""
    run_id = f"{RUN_PREFIX}-{mode}"

    def peer(stage: int):
        return start_peer(
            group,
            f"s{stage}-{mode}",
            stage=stage,
            run_id=run_id,
            addr_file=addr_file,
            where=Where.on(hosts[f"s{stage}"]),
            run_flags=RUN_FLAGS,
        )

    wait_ready(peer(0))
    s1 = peer(1)
    endpoint = wait_ready(s1)
    if mode == "relayed":
        endpoint = s1.wait_for(r"relay \w+ lends this peer the endpoint (\S+)", timeout_s=60).group(
            1
        )
    metrics = workdir / f"metrics-{mode}.jsonl"
    trainer = start_bench_trainer(
        group,
        f"trainer-{mode}",
        run_id=run_id,
        addr_file=addr_file,
        metrics=metrics,
        where=Where.on(hosts["trainer"]),
    )
    _wait_progress(metrics, after_step=0, trainer=trainer, timeout_s=timeout_s)
    return dict(run_id=run_id, endpoint=endpoint, metrics=metrics, trainer=trainer, hosts=hosts)


def measure_rates(modes: dict[str, dict], net, rates, args) -> dict[str, dict]:
    """Both modes' windows at each rate, measured over the same period: {mode: {rate: Window}}."""
    windows = {mode: {} for mode in modes}
    for rate in rates:
        for host in net.hosts:
            host.set_rate(rate)
        with ThreadPoolExecutor(len(modes)) as pool:
            futures = {
                mode: pool.submit(
                    measure_window,
                    {
                        "trainer": m["hosts"]["trainer"],
                        "relay/s0": m["hosts"]["s0"],
                        "s1": m["hosts"]["s1"],
                    },
                    m["metrics"],
                    m["trainer"],
                    rate_mbit=rate,
                    warmup_s=args.warmup_seconds,
                    seconds=args.seconds,
                    min_steps=args.min_steps,
                    timeout_s=args.timeout,
                )
                for mode, m in modes.items()
            }
            for mode, future in futures.items():
                window = windows[mode][rate] = future.result()
                print(
                    f"  {mode} @ {_rate_label(rate)}: {window.tokens_per_s:,.0f} tokens/s over "
                    f"{window.seconds:.0f}s ({window.steps} steps); stage-0 peer's link up/down "
                    f"{window.links['relay/s0'][0]:.1f}/{window.links['relay/s0'][1]:.1f} Mbit/s; "
                    f"load {window.load:.1f}",
                    flush=True,
                )
    return windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rates", default="20,100", help="Mbit/s per link, slowest first (0 = unlimited)"
    )
    parser.add_argument("--warmup-seconds", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=30.0)
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
    with EmulatedNetwork(num_hosts=7, nat_hosts=(5,)) as net, ProcessGroup(workdir) as group:
        boot, *rest = net.hosts
        addr_file = workdir / "bootstrap.addr"
        start_bootstrap(group, addr_file, where=Where.on(boot))
        modes = {}
        for k, mode in enumerate(MODES):
            hosts = dict(zip(("s0", "s1", "trainer"), rest[3 * k : 3 * k + 3]))
            modes[mode] = start_mode(mode, hosts, group, addr_file, workdir, args.timeout)
        started = time.monotonic()
        for host in net.hosts:
            host.set_rate(rates[0])
        windows = measure_rates(modes, net, rates, args)
        for m in modes.values():
            group.stop(m["trainer"].name, sig=signal.SIGINT, timeout_s=30)
        for host in net.hosts:
            host.set_rate(None)
        latency = {mode: [] for mode in MODES}
        for _ in range(2):  # alternating, so a drifting load weighs on both alike
            for mode, m in modes.items():
                latency[mode].append(_probe(m["hosts"]["trainer"], m["endpoint"], m["run_id"]))
                print(f"  {mode}: {latency[mode][-1]}", flush=True)
        print(f"  measured in {time.monotonic() - started:.0f}s", flush=True)
    info.finish()
    body = report(windows, latency, rates)
    path = write_result(
        args.out,
        title="Tokens/s through a relay vs direct, and a relay's latency",
        info=info,
        body=body,
    )
    print("\n" + body + f"\n\nwritten to {path}")


def report(windows: dict[str, dict], latency: dict[str, list], rates) -> str:
    rows = []
    for rate in rates:
        direct, relayed = windows["direct"][rate], windows["relayed"][rate]
        rows.append(
            [
                _rate_label(rate),
                f"{direct.tokens_per_s:,.0f}",
                f"{relayed.tokens_per_s:,.0f}",
                f"{relayed.tokens_per_s / direct.tokens_per_s:.2f}",
                f"{max(direct.links['relay/s0']):.1f} / {max(relayed.links['relay/s0']):.1f}",
                f"{direct.load:.1f} / {relayed.load:.1f}",
            ]
        )
    throughput = markdown_table(
        [
            "link (each host)",
            "direct tokens/s",
            "relayed tokens/s",
            "relayed / direct",
            "stage-0 peer's busier direction, Mbit/s (direct / relayed: it relays)",
            "load at the end (direct / relayed)",
        ],
        rows,
    )

    def median(mode, key):
        return statistics.median(probe[key] for probe in latency[mode])

    lat_rows = [
        [
            what,
            f"{median('direct', key):.2f}",
            f"{median('relayed', key):.2f}",
            f"{median('relayed', key) - median('direct', key):+.2f}",
        ]
        for what, key in (
            ("Info round trip, open channel", "call_ms"),
            ("fresh channel: connect + TLS + first Info", "fresh_ms"),
        )
    ]
    table = markdown_table(
        ["unlimited links, ms (median of 2 probes)", "direct", "relayed", "added by the relay"],
        lat_rows,
    )
    return "\n".join(
        [
            f"The tiny preset (the demo's), int8 codec, 2 stages, microbatch {MICROBATCH}, {IN_FLIGHT} in flight; "
            "the two swarms ran at once, each window over the same period.",
            "",
            throughput,
            "",
            table,
        ]
    )


if __name__ == "__main__":
    main()
