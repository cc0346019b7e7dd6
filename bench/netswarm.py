"""Swarm tokens/s over emulated slow links, per wire codec: every host in its own network namespace.

Run from the repository root as root:  .venv/bin/python bench/netswarm.py [--rates 5,20,100,0] [--w2]
Prints markdown tables and writes them, with the environment, to bench/results/netswarm.md.

Topology (deploy/netns/): 4 emulated hosts on one bridge — a bootstrap DHT node, one peer per stage of the
2-stage model, and the trainer — each with its own address and a tbf limit on its uplink and its downlink.
Relayed (the default), the trainer relays every hop (tokens -> stage 0 -> trainer -> stage 1 -> trainer,
gradients back the same way), so its link carries the most: about 2 activations up and 2 down per microbatch.
With ``--activations relayed,push`` every config also runs with activations pushed peer to peer (the trainer
sends tokens to stage 0, which sends its output to stage 1 and gets the gradient back), and the report adds push
vs relayed at each rate and every host's link traffic (``--repeat 2`` runs each config twice in alternating
order and reports the medians):  .venv/bin/python bench/netswarm.py --configs int8 --activations relayed,push
--rates 5,20,100,0 --repeat 2 --out bench/results/netswarm_push.md

Protocol: for each configuration (codec, bottleneck) the swarm starts once; the trainer runs until stopped.
For each rate, slowest first, every host's link is set to that rate, the swarm warms up (at least
``--warmup-seconds`` and one global batch), then tokens/s is taken between two snapshots of the trainer's
metrics file (at step boundaries; at least ``--seconds`` and ``--min-steps`` global batches apart). Rates go
from slow to fast because the trainer's routing deadlines adapt to measured round trips: a link that gets
suddenly slower would time calls out and ban the only peer of a stage, one that gets faster never does.
Bytes through the trainer's interface in the window give the link's utilisation, which tells whether the
link or the CPUs were the bottleneck.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, RunInfo, load_average, markdown_table, write_result  # noqa: E402

from deploy.netns import EmulatedHost, EmulatedNetwork, have_netns  # noqa: E402
from swarm.coordinator.launcher import ProcessGroup  # noqa: E402
from swarm.coordinator.localswarm import (  # noqa: E402
    Progress,
    Where,
    publish_run_at,
    read_metrics,
    start_bootstrap,
    start_peer,
    start_trainer,
    wait_ready,
)

MICROBATCH = 8  # sequences per microbatch (the demo's)
IN_FLIGHT = 4  # microbatches in the pipeline at once (the demo's)
TARGET_BATCH = 32  # samples per optimizer step of each stage (the demo's)
LR = 3e-3
MAX_DATA_BYTES = 8_000_000  # the trainer loads this much text: faster start, same throughput
KEEP_AT_100 = 0.80  # target: int8 at 100 Mbit/s keeps this share of its unlimited-link tokens/s
INT8_SPEEDUP = (
    3.0  # target: int8 this many times faster than none wherever the link is the bottleneck
)
LINK_BOUND = 0.80  # "the link is the bottleneck" for none at a rate: it keeps less than this share of unlimited


@dataclass(frozen=True, kw_only=True)
class SwarmSetup:
    """One configuration: the swarm is started once for it and measured at each of its rates."""

    name: str  # row label
    preset: str  # model preset (tiny = the demo's)
    codec: str  # wire codec of activations and gradients
    bottleneck_dim: int | None = None  # learned compression width at the stage cut; None = off
    bottleneck_init: str = "random"  # how the bottleneck pair starts (ModelConfig.bottleneck_init)
    # the token ids cross the cut beside the bottleneck (ModelConfig.bottleneck_tokens; scheme suffix +tok)
    bottleneck_tokens: bool = False
    grad_codec: str = "same"  # wire codec of gradients ("same" = codec)
    activations: str = (
        "relayed"  # how activations travel (the trainer's --activations: relayed or push)
    )
    rates_mbit: tuple[float | None, ...] = (5, 20, 100, None)  # slowest first; None = unlimited

    def run_config(self):
        """The run the swarm trains: published once from the bootstrap host, before the peers start (the
        peers' --preset path has no bottleneck flag at every commit, a published record works everywhere)."""
        import dataclasses

        from swarm.config import RunConfig
        from swarm.model import MODEL_PRESETS

        model = dataclasses.replace(
            MODEL_PRESETS[self.preset],
            bottleneck_dim=self.bottleneck_dim,
            bottleneck_init=self.bottleneck_init,
            bottleneck_tokens=self.bottleneck_tokens,
        )
        return RunConfig(
            model=model,
            codec=self.codec,
            grad_codec=self.grad_codec,
            target_batch_size=TARGET_BATCH,
            lr=LR,
        )


@dataclass
class Window:
    """One measured window of one configuration at one rate."""

    rate_mbit: float | None
    tokens_per_s: float
    seconds: float
    steps: int
    sent_mbit_per_s: float  # trainer's uplink, Ethernet bytes (what tbf counts) per second
    received_mbit_per_s: float  # trainer's downlink
    load: float  # 1-minute load average at the end of the window
    # every host's (sent, received) Mbit/s over the window, by host name (boot, peer-s0, peer-s1, trainer)
    links: dict[str, tuple[float, float]] = field(default_factory=dict)

    def busiest(self) -> str:
        """The host whose link's busier direction carried the most."""
        return max(self.links, key=lambda name: max(self.links[name]))

    def utilisation(self) -> float:
        """Busier direction of the trainer's link as a share of the rate (nan when unlimited)."""
        if self.rate_mbit is None:
            return float("nan")
        return max(self.sent_mbit_per_s, self.received_mbit_per_s) / self.rate_mbit


@dataclass
class SetupResult:
    setup: SwarmSetup
    windows: dict[float | None, Window] = field(default_factory=dict)


def _link_bytes(host: EmulatedHost) -> tuple[int, int]:
    """(tx, rx) bytes of the host's interface, read inside its namespace (the kernel's counters)."""
    out = host.run(
        [
            "cat",
            "/sys/class/net/eth0/statistics/tx_bytes",
            "/sys/class/net/eth0/statistics/rx_bytes",
        ],
        timeout_s=10,
    ).stdout.split()
    return int(out[0]), int(out[1])


def _wait_progress(metrics: Path, *, after_step: int, trainer, timeout_s: float) -> Progress:
    """Poll the trainer's metrics file until a step later than ``after_step`` is logged."""
    deadline = time.monotonic() + timeout_s
    while True:
        progress = read_metrics(metrics).progress()
        if progress is not None and progress.step > after_step:
            return progress
        if not trainer.alive():
            raise RuntimeError(
                f"the trainer exited (code {trainer.popen.poll()}); see {trainer.log_path}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no step after {after_step} within {timeout_s:.0f}s; see {trainer.log_path}"
            )
        time.sleep(0.2)  # the trainer appends to a file; there is no event to wait on


def measure_window(
    hosts: dict[str, EmulatedHost],
    metrics: Path,
    trainer,
    *,
    rate_mbit: float | None,
    warmup_s: float,
    seconds: float,
    min_steps: int,
    timeout_s: float,
) -> Window:
    """Warm up at the current rate, then tokens/s and every host's link bytes between two step boundaries
    (``hosts``: by name; "trainer" is the trainer's)."""
    begun = time.monotonic()
    now = read_metrics(metrics).progress()
    # Warmup: at least one step completed entirely at the new rate, and at least warmup_s.
    after = _wait_progress(
        metrics, after_step=(now.step if now else 0) + 1, trainer=trainer, timeout_s=timeout_s
    )
    # a measuring period, not a wait for an event
    time.sleep(max(0.0, warmup_s - (time.monotonic() - begun)))
    start = _wait_progress(metrics, after_step=after.step, trainer=trainer, timeout_s=timeout_s)
    before, t0 = {name: _link_bytes(h) for name, h in hosts.items()}, time.monotonic()
    end = start
    while end.step < start.step + min_steps or time.monotonic() - t0 < seconds:
        end = _wait_progress(metrics, after_step=end.step, trainer=trainer, timeout_s=timeout_s)
    after, t1 = {name: _link_bytes(h) for name, h in hosts.items()}, time.monotonic()
    links = {
        name: tuple((after[name][i] - before[name][i]) * 8 / (t1 - t0) / 1e6 for i in (0, 1))
        for name in hosts
    }
    # Byte counters are read at our clock, steps at the trainer's: both span the same steps to within a poll.
    return Window(
        rate_mbit=rate_mbit,
        tokens_per_s=end.tokens_per_s_since(start),
        seconds=end.time_s - start.time_s,
        steps=end.step - start.step,
        sent_mbit_per_s=links["trainer"][0],
        received_mbit_per_s=links["trainer"][1],
        load=load_average(),
        links=links,
    )


def start_bench_trainer(
    group: ProcessGroup,
    name: str,
    *,
    run_id: str,
    addr_file: Path,
    metrics: Path,
    where: Where,
    activations: str = "relayed",
):
    """The benchmarks' trainer: runs until stopped, the demo's microbatches, progress in ``metrics``."""
    return start_trainer(
        group,
        name,
        run_id=run_id,
        addr_file=addr_file,
        metrics_path=metrics,
        steps=0,
        where=where,
        microbatch_size=MICROBATCH,
        in_flight=IN_FLIGHT,
        eval_every_steps=0,
        eval_batches=1,
        log_every_s=10,
        max_bytes=MAX_DATA_BYTES,
        activations=activations,
    )


def measure_setup(
    setup: SwarmSetup,
    workdir: Path,
    *,
    warmup_s: float,
    seconds: float,
    min_steps: int,
    timeout_s: float,
) -> SetupResult:
    """Start the swarm of ``setup`` on 4 emulated hosts once and measure each of its rates."""
    result = SetupResult(setup)
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    with (
        EmulatedNetwork(num_hosts=4, rate_mbit=setup.rates_mbit[0]) as net,
        ProcessGroup(workdir) as group,
    ):
        boot, peer0, peer1, trainer_host = net.hosts
        addr_file = workdir / "bootstrap.addr"
        started = time.monotonic()
        start_bootstrap(group, addr_file, where=Where.on(boot))
        run_id = f"net-{setup.name}".replace("+", "-").replace("/", "-")
        publish_run_at(Where.on(boot), addr_file, run_id, setup.run_config(), timeout_s=timeout_s)
        peers = [
            start_peer(
                group,
                f"peer-s{k}",
                stage=k,
                run_id=run_id,
                addr_file=addr_file,
                where=Where.on(host),
            )
            for k, host in enumerate((peer0, peer1))
        ]
        for proc in peers:
            wait_ready(proc)
        trainer = start_bench_trainer(
            group,
            "trainer",
            run_id=run_id,
            addr_file=addr_file,
            metrics=metrics,
            where=Where.on(trainer_host),
            activations=setup.activations,
        )
        _wait_progress(metrics, after_step=0, trainer=trainer, timeout_s=timeout_s)
        print(
            f"  {setup.name}: swarm up and training after {time.monotonic() - started:.0f}s",
            flush=True,
        )
        for rate in setup.rates_mbit:
            for host in net.hosts:
                host.set_rate(rate)
            window = measure_window(
                dict(zip(("boot", "peer-s0", "peer-s1", "trainer"), net.hosts)),
                metrics,
                trainer,
                rate_mbit=rate,
                warmup_s=warmup_s,
                seconds=seconds,
                min_steps=min_steps,
                timeout_s=timeout_s,
            )
            result.windows[rate] = window
            print(
                f"  {setup.name} @ {_rate_label(rate)}: {window.tokens_per_s:,.0f} tokens/s over "
                f"{window.seconds:.0f}s ({window.steps} steps); trainer link up {window.sent_mbit_per_s:.1f} / "
                f"down {window.received_mbit_per_s:.1f} Mbit/s; busiest link {window.busiest()}; "
                f"load {window.load:.1f}",
                flush=True,
            )
        group.stop("trainer", sig=signal.SIGINT, timeout_s=30)
        retried = sum("retrying elsewhere" in line for line in trainer.lines)
        if retried:
            print(
                f"  {setup.name}: the trainer retried {retried} calls at another peer (see {trainer.log_path})",
                flush=True,
            )
    return result


# ---------------------------------------------------------------------------------------- report


def _ratio_cells(res, reference, rates) -> list[str]:
    """``res``'s tokens/s over ``reference``'s at each rate ("" where either has no window there)."""
    cells = []
    for rate in rates:
        a, b = res.windows.get(rate), reference.windows.get(rate)
        cells.append("" if a is None or b is None else f"{a.tokens_per_s / b.tokens_per_s:.2f}x")
    return cells


def _rate_label(rate: float | None) -> str:
    return "unlimited" if rate is None else f"{rate:g} Mbit/s"


def tables(results: list[SetupResult]) -> tuple[str, str, list[str]]:
    """(throughput table, int8-vs-none table, target verdicts)."""
    rates = list(dict.fromkeys(r for res in results for r in res.setup.rates_mbit))
    rows = []
    for res in results:
        base = res.windows.get(None)
        row = [f"{res.setup.name} ({res.setup.preset})"]
        for rate in rates:
            w = res.windows.get(rate)
            if w is None:
                row.append("")
                continue
            cell = f"{w.tokens_per_s:,.0f}"
            if rate is not None and base is not None:
                cell += f" ({w.tokens_per_s / base.tokens_per_s:.0%}; link {w.utilisation():.0%})"
            row.append(cell)
        rows.append(row)
    throughput = markdown_table(["config"] + [_rate_label(r) for r in rates], rows)

    by_name = {
        (res.setup.preset, res.setup.codec, res.setup.bottleneck_dim): res for res in results
    }
    ratio_rows, verdicts = [], []
    for preset in dict.fromkeys(res.setup.preset for res in results):
        none = by_name.get((preset, "none", None))
        if none is None:
            continue
        for res in results:
            if res.setup.preset != preset or res is none:
                continue
            ratio_rows.append(
                [f"{res.setup.name} / none ({preset})", *_ratio_cells(res, none, rates)]
            )
        int8 = by_name.get((preset, "int8", None))
        if int8 is None:
            continue
        if 100 in int8.windows and None in int8.windows and preset == "tiny":
            keep = int8.windows[100].tokens_per_s / int8.windows[None].tokens_per_s
            verdicts.append(
                f"{preset}, int8 at 100 Mbit/s keeps {keep:.0%} of its unlimited-link tokens/s "
                f"(target >= {KEEP_AT_100:.0%}): {'met' if keep >= KEEP_AT_100 else '**missed**'}"
            )
        base = none.windows.get(None)
        for rate in rates:
            if rate is None or rate not in none.windows or rate not in int8.windows or base is None:
                continue
            keep_none = none.windows[rate].tokens_per_s / base.tokens_per_s
            if keep_none >= LINK_BOUND:
                continue  # the link is not the bottleneck for none here: the 3x target does not apply
            speedup = int8.windows[rate].tokens_per_s / none.windows[rate].tokens_per_s
            int8_keep = (
                int8.windows[rate].tokens_per_s / int8.windows[None].tokens_per_s
                if None in int8.windows
                else float("nan")
            )
            bound = (
                "link-bound"
                if int8_keep < LINK_BOUND
                else f"compute-bound, {int8_keep:.0%} of unlimited"
            )
            verdicts.append(
                f"{preset} at {_rate_label(rate)}: none is link-bound ({keep_none:.0%} of unlimited); "
                f"int8 is {speedup:.2f}x faster (target >= {INT8_SPEEDUP:g}x): "
                f"{'met' if speedup >= INT8_SPEEDUP else '**missed**'}; int8 itself is {bound}"
            )
    ratios = markdown_table(["ratio of tokens/s"] + [_rate_label(r) for r in rates], ratio_rows)
    return throughput, ratios, verdicts


def default_setups(
    rates: tuple[float | None, ...], *, w2: bool, w2_rates: tuple[float | None, ...]
) -> list[SwarmSetup]:
    setups = [
        SwarmSetup(name="none", preset="tiny", codec="none", rates_mbit=rates),
        SwarmSetup(name="fp16", preset="tiny", codec="fp16", rates_mbit=rates),
        SwarmSetup(name="int8", preset="tiny", codec="int8", rates_mbit=rates),
        SwarmSetup(
            name="int8+bottleneck32",
            preset="tiny",
            codec="int8",
            bottleneck_dim=32,
            rates_mbit=rates,
        ),
    ]
    if w2:
        setups += [
            SwarmSetup(name="none", preset="w2", codec="none", rates_mbit=w2_rates),
            SwarmSetup(name="int8", preset="w2", codec="int8", rates_mbit=w2_rates),
        ]
    return setups


def scheme_setups(schemes: str, rates: tuple[float | None, ...]) -> list[SwarmSetup]:
    """Setups on `tiny` from bench/quality.py's scheme syntax (CODEC, CODEC+bnN, CODEC+bnN+orth, CODEC+bnN+tok)."""
    from quality import Scheme

    setups = []
    for text in filter(None, schemes.split(",")):
        scheme = Scheme.parse(text)
        setups.append(
            SwarmSetup(
                name=scheme.label,
                preset="tiny",
                codec=scheme.codec,
                bottleneck_dim=scheme.bottleneck_dim,
                bottleneck_init=scheme.bottleneck_init,
                bottleneck_tokens=scheme.bottleneck_tokens,
                grad_codec=scheme.grad_codec,
                rates_mbit=rates,
            )
        )
    return setups


def median_windows(results: list[SetupResult]) -> list[SetupResult]:
    """One result per config: at each rate, the window of median tokens/s among its repeats (the lower middle one
    of an even count)."""
    merged: dict[str, SetupResult] = {}
    for res in results:
        merged.setdefault(res.setup.name, SetupResult(res.setup))
    for name, out in merged.items():
        for rate in out.setup.rates_mbit:
            windows = sorted(
                (
                    res.windows[rate]
                    for res in results
                    if res.setup.name == name and rate in res.windows
                ),
                key=lambda w: w.tokens_per_s,
            )
            if windows:
                out.windows[rate] = windows[(len(windows) - 1) // 2]
    return list(merged.values())


def activation_variants(setups: list[SwarmSetup], modes: list[str]) -> list[SwarmSetup]:
    """Each setup once per activation mode, side by side; a push variant is named NAME-push."""
    import dataclasses

    return [
        dataclasses.replace(
            s, activations=mode, name=s.name if mode == "relayed" else f"{s.name}-{mode}"
        )
        for s in setups
        for mode in modes
    ]


PUSH_SPEEDUP_AT_20 = 1.5  # target: push >= this many times relayed's tokens/s at 20 Mbit/s, int8


def push_tables(results: list[SetupResult]) -> tuple[str, str, list[str]]:
    """(push / relayed ratios, per-link traffic, target verdicts) for the setups run in both modes."""
    by_name = {res.setup.name: res for res in results}
    rates = list(dict.fromkeys(r for res in results for r in res.setup.rates_mbit))
    ratio_rows, link_rows, verdicts = [], [], []
    for res in results:
        if res.setup.activations != "push":
            continue
        relayed = by_name.get(res.setup.name.removesuffix("-push"))
        if relayed is None:
            continue
        ratio_rows.append(
            [f"{res.setup.name} / {relayed.setup.name}", *_ratio_cells(res, relayed, rates)]
        )
        for pair in (relayed, res):
            for rate, w in pair.windows.items():
                tokens = w.tokens_per_s
                cells = [
                    f"{max(w.links[h]):.1f} ({(w.links[h][0] + w.links[h][1]) * 1e6 / 8 / tokens:,.0f})"
                    for h in ("trainer", "peer-s0", "peer-s1", "boot")
                ]
                link_rows.append(
                    [
                        f"{pair.setup.name} @ {_rate_label(rate)}",
                        f"{tokens:,.0f}",
                        *cells,
                        w.busiest(),
                    ]
                )
        fast = res.windows.get(20)
        slow = relayed.windows.get(20)
        if fast is not None and slow is not None and res.setup.codec == "int8":
            ratio = fast.tokens_per_s / slow.tokens_per_s
            verdicts.append(
                f"{res.setup.name} at 20 Mbit/s: {ratio:.2f}x relayed's tokens/s (target >= "
                f"{PUSH_SPEEDUP_AT_20:g}x): {'met' if ratio >= PUSH_SPEEDUP_AT_20 else '**missed**'}"
            )
        for rate, w in res.windows.items():
            verdicts.append(
                f"{res.setup.name} at {_rate_label(rate)}: the busiest link is {w.busiest()}'s"
                + (" (target: not the trainer's): **missed**" if w.busiest() == "trainer" else "")
            )
    ratios = markdown_table(["ratio of tokens/s"] + [_rate_label(r) for r in rates], ratio_rows)
    links = markdown_table(
        [
            "config @ rate",
            "tokens/s",
            "trainer",
            "stage-0 peer",
            "stage-1 peer",
            "bootstrap",
            "busiest",
        ],
        link_rows,
    )
    return ratios, links, verdicts


def versus(results: list[SetupResult], baseline: str) -> str:
    """Tokens/s of every setup divided by ``baseline``'s at the same rate, measured in this run."""
    reference = next((r for r in results if r.setup.name == baseline), None)
    if reference is None:
        return f"(no {baseline} run to compare with)"
    rates = list(dict.fromkeys(r for res in results for r in res.setup.rates_mbit))
    rows = []
    for res in results:
        if res is reference:
            continue
        rows.append(
            [
                f"{res.setup.name} / {baseline} ({res.setup.preset})",
                *_ratio_cells(res, reference, rates),
            ]
        )
    return markdown_table(["ratio of tokens/s"] + [_rate_label(r) for r in rates], rows)


def _parse_rates(text: str) -> tuple[float | None, ...]:
    rates = [float(r) or None for r in text.split(",") if r]
    limited = sorted(r for r in rates if r is not None)
    return (*limited, *([None] if None in rates else []))  # slowest first, unlimited last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="5,20,100,0", help="Mbit/s per host link, 0 = unlimited")
    parser.add_argument(
        "--w2", action="store_true", help="also W2 (--preset w2, 4 MiB activations): none, int8"
    )
    parser.add_argument("--w2-rates", default="20,100,0", help="rates for the W2 configurations")
    parser.add_argument("--configs", default=None, help="only these config names, comma-separated")
    parser.add_argument(
        "--schemes",
        default="",
        help="more configs on tiny, in bench/quality.py's scheme syntax (e.g. int2+bn48,int4+bn28+orth,"
        "int4+bn26+tok)",
    )
    parser.add_argument(
        "--baseline",
        default="int8+bottleneck32",
        help="config every other one is also compared with (tokens/s ratio at each rate)",
    )
    parser.add_argument(
        "--activations",
        default="relayed",
        help="activation modes to run each config in, comma-separated (relayed, push); with both, a push vs "
        "relayed table and every host's link traffic are reported",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every config, in alternating order; medians reported",
    )
    parser.add_argument("--seconds", type=float, default=12.0, help="least measured time per rate")
    parser.add_argument(
        "--min-steps", type=int, default=3, help="least global batches measured per rate"
    )
    parser.add_argument(
        "--warmup-seconds", type=float, default=4.0, help="least time at a rate before measuring"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=240.0, help="longest wait for one step or startup"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="process logs (default: a temporary folder)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "netswarm.md")
    args = parser.parse_args()
    ok, why = have_netns()
    if not ok:
        raise SystemExit(f"bench/netswarm.py needs network namespaces: {why}")
    setups = default_setups(
        _parse_rates(args.rates), w2=args.w2, w2_rates=_parse_rates(args.w2_rates)
    )
    if args.configs is not None:
        wanted = set(args.configs.split(","))
        setups = [s for s in setups if s.name in wanted]
    setups += scheme_setups(args.schemes, _parse_rates(args.rates))
    setups = activation_variants(setups, args.activations.split(","))
    info = RunInfo(
        command="sudo .venv/bin/python bench/netswarm.py" + "".join(f" {a}" for a in sys.argv[1:])
    )
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="swarm-netbench-"))
    print(f"logs in {workdir}", flush=True)
    # Repeats alternate the order (A B, B A, ...), so a load that drifts during the run weighs on every config alike.
    order = [(r, s) for r in range(args.repeat) for s in (setups if r % 2 == 0 else setups[::-1])]
    results = median_windows(
        [
            measure_setup(
                s,
                workdir / f"{s.preset}-{s.name}-{r}".replace("/", "-"),
                warmup_s=args.warmup_seconds,
                seconds=args.seconds,
                min_steps=args.min_steps,
                timeout_s=args.timeout_s,
            )
            for r, s in order
        ]
    )
    info.finish()
    throughput, ratios, verdicts = tables(results)
    push_ratios, links, push_verdicts = push_tables(results)
    info.extra += [
        "topology: 4 network namespaces on one bridge (deploy/netns/) — bootstrap DHT node, stage-0 peer, "
        "stage-1 peer, trainer; every host's uplink and downlink limited by tbf to the rate of the column",
        f"swarm: 2 stages x 1 peer (`--threads 1`), trainer OMP_NUM_THREADS=1, microbatch {MICROBATCH}, "
        f"in flight {IN_FLIGHT}, target batch {TARGET_BATCH}; per rate (slowest first) >= {args.warmup_seconds:g}s "
        f"and 1 step of warmup, then >= {args.seconds:g}s and >= {args.min_steps} steps measured; each config "
        f"run {args.repeat} time(s) in alternating order, the median window per rate reported",
    ]
    body = "\n".join(
        [
            "Tokens/s of the trainer (in brackets: share of the same swarm's unlimited-link tokens/s, and the "
            "utilisation of the trainer's link — its busier direction — as a share of the rate):",
            "",
            throughput,
            "",
            "Speed-up over codec none at the same rate:",
            "",
            ratios,
            "",
            f"Against {args.baseline}, at the same rate:",
            "",
            versus(results, args.baseline),
            "",
            "Targets:",
            "",
            *(f"- {v}" for v in verdicts),
            *(
                [
                    "",
                    "Push (activations peer to peer) against relayed (through the trainer), same codec and rate:",
                    "",
                    push_ratios,
                    "",
                    "Every host's link: the busier direction in Mbit/s (in brackets: bytes sent plus received per "
                    "token trained), and the busiest host:",
                    "",
                    links,
                    "",
                    *(f"- {v}" for v in push_verdicts),
                ]
                if push_verdicts
                else []
            ),
        ]
    )
    path = write_result(
        args.out, title="Swarm tokens/s over emulated slow links, per codec", info=info, body=body
    )
    print(
        "\n"
        + throughput
        + "\n\n"
        + ratios
        + "\n\n"
        + "\n".join(verdicts + push_verdicts)
        + (f"\n\n{push_ratios}\n\n{links}" if push_verdicts else "")
        + f"\n\nwritten to {path}"
    )


if __name__ == "__main__":
    main()
