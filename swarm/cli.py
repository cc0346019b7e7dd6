"""``swarm`` command line: parses flags (built from the config dataclasses), then calls in."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Collection
from pathlib import Path

from swarm.argconfig import add_config_args, advanced_last, config_from_args
from swarm.cliconfig import ConfigError, add_config_flags, apply_defaults, render
from swarm.runflags import add_run_flags, run_config_from_args

CONFIG_HELP = (
    "Flags may also come from a TOML file (--config FILE, its [COMMAND] table) and from SWARM_<FLAG> "
    "environment variables; the command line wins, then the environment, then the file."
)


def _dht_flags(p: argparse.ArgumentParser) -> None:
    from swarm.discovery.config import DHTConfig

    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)"
    )
    p.add_argument(
        "--announce-host", default=None, help="address others should dial, if not --host"
    )
    p.add_argument(
        "--address-file", default=None, help="also write the node's multiaddrs here, one per line"
    )
    add_config_args(p, DHTConfig)


def _peer_flags(p: argparse.ArgumentParser) -> None:
    from swarm.peer.config import PeerConfig

    add_config_args(p, PeerConfig)
    add_run_flags(p)


def _train_flags(p: argparse.ArgumentParser) -> None:
    from swarm.trainer.config import TrainerConfig

    add_config_args(p, TrainerConfig)


def _run_in_dht_flags(p: argparse.ArgumentParser) -> None:
    """--run-id and the DHT flags: what the commands that look a run up in the DHT share."""
    from swarm.discovery.config import DHTConfig

    p.add_argument("--run-id", default="demo", help="the run (default: demo)")
    add_config_args(p, DHTConfig)


def _status_flags(p: argparse.ArgumentParser) -> None:
    _run_in_dht_flags(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object instead of text (schema: swarm.coordinator.status, README)",
    )
    p.add_argument(
        "--list-runs",
        action="store_true",
        help="list the runs published in the DHT instead (with --json: one object)",
    )
    p.add_argument(
        "--watch",
        type=float,
        default=None,
        metavar="SECONDS",
        help="print the status again every SECONDS until interrupted (--json: one object per line)",
    )


def _monitor_flags(p: argparse.ArgumentParser) -> None:
    _run_in_dht_flags(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="address the dashboard listens on (default: 127.0.0.1)"
    )
    p.add_argument(
        "--port", type=int, default=8080, help="its port (0 = any free port; default: 8080)"
    )
    p.add_argument(
        "--period-s",
        type=float,
        default=1.0,
        help="seconds between two reads of the run's status from the DHT (default: 1.0)",
    )


def _export_flags(p: argparse.ArgumentParser) -> None:
    _run_in_dht_flags(p)
    p.add_argument(
        "--out",
        required=True,
        help="directory to write: model.safetensors, config.json (transformers loads GPT-2 and Llama "
        "exports) and swarm.json (see swarm.coordinator.exportdir)",
    )
    p.add_argument(
        "--allow-disagreement",
        action="store_true",
        help="export even if a stage's replicas at its highest step hold different parameters "
        "(takes the most advanced replica's)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the local tokenizer directory the run trained with (swarm train --tokenizer): its files go into "
        "the export, and swarm generate uses them",
    )


def _callers_flags(p: argparse.ArgumentParser) -> None:
    _run_in_dht_flags(p)
    p.add_argument(
        "--allow",
        nargs="+",
        metavar="ID",
        help="admit only these keys at every peer of the run (peer ids or fingerprints, or @FILE), and the "
        "owner's; run as the owner (--identity-path of the key that created the run)",
    )
    p.add_argument(
        "--open", action="store_true", help="admit any identified caller again (the default)"
    )
    p.add_argument(
        "--ttl-s",
        type=float,
        default=7 * 24 * 3600.0,
        help="seconds the list lives in the DHT; publish it again before (default: 7 days)",
    )


def _generate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint", required=True, help="directory (or older file) written by `swarm export`"
    )
    p.add_argument("--prompt", default="def ", help="text the sample continues")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=200,
        help="tokens to generate: bytes, or the exported tokenizer's tokens (default: 200)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0 picks the most likely byte (default: 0.8)",
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="sample among the k most likely bytes only"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where the model runs: auto (a GPU when torch sees one), cpu, cuda, cuda:N or mps (default: cpu)",
    )


def _plot_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "metrics",
        nargs="+",
        metavar="METRICS.jsonl",
        help="files written by swarm train --metrics-path",
    )
    p.add_argument(
        "--out", default="curves.png", help="picture to write (PNG by default; default: curves.png)"
    )


def _demo_flags(p: argparse.ArgumentParser) -> None:
    from swarm.coordinator.demo import DemoConfig

    add_config_args(p, DemoConfig)


def _simulate_flags(p: argparse.ArgumentParser) -> None:
    from swarm.sim.main import build_parser as simulator_flags

    simulator_flags(p)


# Each command: its one-line help and the function adding its flags. The flags of a command are built only
# when it runs (or shows its help): they come from config classes whose modules import torch or hivemind,
# which `swarm --help` must not wait for.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "dht": ("run a DHT bootstrap node and print the address to give others", _dht_flags),
    "peer": ("serve one stage of a run", _peer_flags),
    "train": ("train: stream microbatches through the swarm", _train_flags),
    "status": ("show the peers of every stage of a run", _status_flags),
    "monitor": (
        "serve a live dashboard of a run (a web page: stages, replicas, agreement, bottleneck)",
        _monitor_flags,
    ),
    "export": (
        "gather the latest state of every stage from live peers into one file",
        _export_flags,
    ),
    "callers": (
        "show or set (as the run's owner) which keys the run's peers admit",
        _callers_flags,
    ),
    "generate": ("sample text from an exported model (--device: CPU or GPU)", _generate_flags),
    "plot": ("draw loss and throughput curves from trainers' metrics files", _plot_flags),
    "demo": (
        "start a local swarm (bootstrap, peers, trainer) and train a small model",
        _demo_flags,
    ),
    "simulate": (
        "simulate a swarm of many peers with the real routing and rebalancing policies (no "
        "processes, no network)",
        _simulate_flags,
    ),
}


def version() -> str:
    try:
        return importlib.metadata.version("swarm")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``swarm`` parser, with the flags of ``commands`` (None: every command's)."""
    parser = argparse.ArgumentParser(
        prog="swarm",
        description="SWARM-parallel training over unreliable peers. `swarm COMMAND --help` shows a "
        "command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"swarm {version()}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("SWARM_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="log level (default: INFO, or $SWARM_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # each command's own parser, for swarm.cliconfig
    parser.commands = {}  # type: ignore[attr-defined]
    for name, (help_text, add_flags) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=f"{help_text}. {CONFIG_HELP}",
        )
        parser.commands[name] = p
        if commands is None or name in commands:
            add_flags(p)
            add_config_flags(p)
            advanced_last(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from swarm.errors import SwarmError, UsageError

    # Ctrl-C (SIGINT) stops every command, also one started with SIGINT ignored (a command in the background of
    # a script, or the child of a program whose libraries set it so, as hivemind's averagers do): Python would
    # leave it ignored, and `swarm status --watch` or a peer could then only be killed.
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    ):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:] if argv is None else list(argv)
    # Only the command given gets its flags (and imports what they need): `swarm --help` stays instant.
    command = next((arg for arg in argv if arg in COMMANDS), None)
    try:
        # the peer's flags import hivemind: an unsupported version stops here, with a sentence
        parser = build_parser(() if command is None else (command,))
    except SwarmError as e:
        return _error("", e, RUNTIME_ERROR)
    if command is not None:
        try:
            apply_defaults(parser.commands[command], command, argv)
        except ConfigError as e:
            return _error(command, e, USAGE_ERROR)
    args = parser.parse_args(argv)
    if getattr(args, "print_config", False):
        print(render(parser.commands[command], command, args), end="")
        return 0
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # hivemind's own INFO lines (matchmaking chatter) drown ours; keep its warnings and errors.
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    logging.getLogger("hivemind").setLevel(os.environ["HIVEMIND_LOGLEVEL"])
    handler = {
        "dht": _dht,
        "peer": _peer,
        "train": _train,
        "status": _status,
        "monitor": _monitor,
        "demo": _demo,
        "simulate": _simulate,
        "export": _export,
        "callers": _callers,
        "generate": _generate,
        "plot": _plot,
    }[args.command]
    try:
        return handler(args)
    except (
        UsageError
    ) as e:  # the user's own input (a data path): a SwarmError, but fixed by the user
        return _error(args.command, e, USAGE_ERROR)
    except (
        SwarmError,
        TimeoutError,
        OSError,
    ) as e:  # the swarm, the network or the machine failed the run
        return _error(args.command, e, RUNTIME_ERROR)
    except ValueError as e:  # a flag's value failed the config checks (__post_init__)
        return _error(args.command, e, USAGE_ERROR)
    except KeyboardInterrupt:
        return 130


# Exit statuses: 1 when the run failed (no peer, retries spent, a timeout), 2 when the command line was wrong
# (as argparse does for unknown flags): a script can tell "try again later" from "fix the command".
RUNTIME_ERROR, USAGE_ERROR = 1, 2


def _error(command: str, error: BaseException, status: int) -> int:
    """Print ``error`` as one line (its message says what failed and what to do), no traceback."""
    where = f"swarm {command}" if command else "swarm"
    print(f"{where}: error: {' '.join(str(error).split())}", file=sys.stderr)
    return status


def _run(coro) -> int:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # uvloop is a dependency, but stay usable where it cannot be installed
        return asyncio.run(coro)


async def _until_signal(on_first=None, *, or_when: asyncio.Event | None = None) -> None:
    """Wait for SIGINT or SIGTERM (or for ``or_when`` to be set); run ``on_first`` once; a signal then interrupts
    it."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waits = {asyncio.ensure_future(stop.wait())}
    if or_when is not None:
        waits.add(asyncio.ensure_future(or_when.wait()))
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in pending:
        wait.cancel()
    if on_first is not None:
        stop.clear()
        work = asyncio.ensure_future(on_first())
        interrupted = asyncio.ensure_future(stop.wait())
        await asyncio.wait({work, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        work.cancel()
        interrupted.cancel()


def _dht(args) -> int:
    from swarm.discovery.dht import DHTConfig, start_dht, visible_addresses

    async def main() -> int:
        dht = await asyncio.to_thread(
            start_dht,
            config_from_args(DHTConfig, args),
            host=args.host,
            announce_host=args.announce_host,
        )
        try:
            addrs = visible_addresses(dht)
            if args.address_file:
                tmp = Path(args.address_file + ".tmp")
                tmp.write_text("\n".join(addrs) + "\n")
                tmp.replace(args.address_file)  # atomic: readers never see a half-written file
            print(
                "DHT node is up. Give others one of these addresses as --initial-peers:", flush=True
            )
            for addr in addrs:
                print(f"  {addr}", flush=True)
            await _until_signal()
        finally:
            dht.shutdown()
        return 0

    return _run(main())


def _peer(args) -> int:
    from swarm.discovery.watch import EXIT_DHT_LOST
    from swarm.peer.config import PeerConfig
    from swarm.peer.heap import bound_heap, trim_heap_forever
    from swarm.peer.lifecycle import Peer

    config = config_from_args(PeerConfig, args)
    run = run_config_from_args(args, config.pretrained)
    bound_heap()  # freed memory is reused while computing, and trimmed back every few seconds

    async def main() -> int:
        peer = await Peer.create(config, run=run)
        trimming = asyncio.create_task(trim_heap_forever())
        try:
            print(
                f"peer {peer.peer_id} serves stage {peer.stage_index} of run '{config.run_id}' at {peer.endpoint}",
                flush=True,
            )
            for addr in peer.addresses():
                print(f"  DHT address (usable as --initial-peers): {addr}", flush=True)
            # SIGUSR1: an operator moves this peer to the stage that needs it most (see Peer.request_move)
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, peer.request_move)
            # a signal drains it; so does the loss of its DHT node, after which it exits for a supervisor to restart
            await _until_signal(on_first=peer.drain, or_when=peer.dht_lost)
        finally:
            trimming.cancel()
            await peer.shutdown()
        return EXIT_DHT_LOST if peer.dht_lost.is_set() else 0

    return _run_or_exit_now(main())


def _run_or_exit_now(coro) -> int:
    """:func:`_run`, but a command that stopped because its DHT node was lost (or could not start for that reason:
    DHTLost, said in one line) ends the process at once: threads that still wait on the node would hold the
    interpreter's exit."""
    from swarm.discovery.watch import EXIT_DHT_LOST, DHTLost

    async def run() -> int:
        try:
            return await coro
        except DHTLost as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_DHT_LOST

    code = _run(run())
    if code == EXIT_DHT_LOST:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process now, with ``code``, after its multiprocessing children (what a normal exit would stop)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _train(args) -> int:
    from swarm.discovery.watch import EXIT_DHT_LOST
    from swarm.trainer.trainer import Trainer, TrainerConfig

    config = config_from_args(TrainerConfig, args)

    async def main() -> int:
        async with Trainer.open(config) as trainer:
            task = asyncio.ensure_future(trainer.train())
            stopper = asyncio.ensure_future(_until_signal(or_when=trainer.dht_lost))
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not task.done():
                task.cancel()
                if trainer.dht_lost.is_set():
                    return EXIT_DHT_LOST
                print("\ninterrupted", flush=True)
                return 130
            summary = task.result()
            print(summary.describe(), flush=True)
        return 0

    return _run_or_exit_now(main())


def _status(args) -> int:
    from swarm.coordinator.status import print_runs, print_status
    from swarm.discovery.config import DHTConfig

    if args.list_runs:
        return _run(print_runs(config_from_args(DHTConfig, args), as_json=args.json))
    return _run(
        print_status(
            args.run_id, config_from_args(DHTConfig, args), as_json=args.json, watch_s=args.watch
        )
    )


def _monitor(args) -> int:
    from swarm.coordinator.monitor import run_monitor
    from swarm.discovery.config import DHTConfig

    return _run(
        run_monitor(
            args.run_id,
            config_from_args(DHTConfig, args),
            host=args.host,
            port=args.port,
            period_s=args.period_s,
        )
    )


def _demo(args) -> int:
    from swarm.coordinator.demo import DemoConfig, run_demo

    return run_demo(config_from_args(DemoConfig, args))


def _export(args) -> int:
    from swarm.coordinator.export import export_run
    from swarm.discovery.config import DHTConfig

    print(
        _run(
            export_run(
                args.run_id,
                config_from_args(DHTConfig, args),
                args.out,
                allow_disagreement=args.allow_disagreement,
                tokenizer=args.tokenizer,
            )
        )
    )
    return 0


def _callers(args) -> int:
    from swarm.coordinator.callers import manage_callers
    from swarm.discovery.config import DHTConfig

    print(
        _run(
            manage_callers(
                args.run_id,
                config_from_args(DHTConfig, args),
                allow=args.allow,
                open_run=args.open,
                ttl_s=args.ttl_s,
            )
        )
    )
    return 0


def _generate(args) -> int:
    from swarm.coordinator.export import generate_text

    if args.max_new_tokens < 1 or args.temperature < 0:
        raise ValueError(
            f"need --max-new-tokens >= 1 and --temperature >= 0, got {args.max_new_tokens} and "
            f"{args.temperature}"
        )
    print(
        generate_text(
            args.checkpoint,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            device=args.device,
        )
    )
    return 0


def _plot(args) -> int:
    from swarm.coordinator.plot import plot

    print(f"wrote {plot([Path(m) for m in args.metrics], Path(args.out))}")
    return 0


def _simulate(args) -> int:
    from swarm.sim.main import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
