"""What the swarm's defences cost a training step: TLS and spot-checks at the default share, each alone and together,
against plaintext peers and no checks, measured in CPU time per microbatch.

Run from the repository root:  .venv/bin/python bench/security_cost.py [--microbatches 16] [--rounds 6]
Writes bench/results/security_cost.md.

Why CPU time, in one process. TLS and spot-checks cost work: encryption of every byte on both ends of a hop, and one
more forward at another replica for a share of the calls. Timed as tokens/s of whole swarms of processes, the
effect (a few percent) drowned on this 2-core machine in noise of +-30% between runs of the same mode (other
processes, the DHT daemons' background work, memory growth): see the git history of this file. Here every peer and
the trainer's pipeline run in this process (real gRPC servers and channels, real TLS, real peers with their
executors; each peer's DHT and p2pd are separate processes and not counted), so ``time.process_time()`` counts the
work of every side of every hop; load from other processes slows it down but hardly changes the CPU it takes.

The swarm: two runs side by side, one whose peers serve TLS (the default) and one whose peers serve ``--plaintext``;
each has 2 stages x 2 replicas of the tiny preset (codec int8, 1 torch thread), which do not average (in-process
peers cannot run hivemind's averager; a spot-check's cost, one forward at another replica, is the same either way:
the replica computes it before anyone compares steps). Four trainer pipelines, one per mode; each round runs
``--microbatches`` microbatches of 8 samples per mode, 4 in flight, the modes in one order in even rounds and the
reverse in odd ones, and waits for every spot-check the mode started. Callers are authenticated in every mode.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402
from hop_overhead import LoopThread  # noqa: E402

from swarm.averaging.config import AveragingConfig  # noqa: E402
from swarm.config import RunConfig  # noqa: E402
from swarm.discovery.dht import DHTConfig, start_dht, visible_addresses  # noqa: E402
from swarm.model.config import MODEL_PRESETS  # noqa: E402
from swarm.peer.config import PeerConfig  # noqa: E402
from swarm.peer.lifecycle import Peer  # noqa: E402
from swarm.trainer.config import PipelineConfig  # noqa: E402
from swarm.trainer.pipeline import Pipeline  # noqa: E402

DEFAULT_SHARE = PipelineConfig().spot_check_share
TRANSPORTS = ("plaintext", "TLS")
# (transport, spot-check share); the first is the baseline every other mode is divided by
MODES = [("plaintext", 0.0), ("TLS", 0.0), ("plaintext", DEFAULT_SHARE), ("TLS", DEFAULT_SHARE)]
MODEL = MODEL_PRESETS["tiny"]
REPLICAS, MICROBATCH, IN_FLIGHT = 2, 8, 4


def label(mode: tuple[str, float]) -> str:
    transport, share = mode
    return f"{transport}, spot-checks {share:g}" + (" (default)" if share == DEFAULT_SHARE else "")


async def start_peers(run: RunConfig, boot: list[str]) -> dict[str, list[Peer]]:
    peers: dict[str, list[Peer]] = {}
    for transport in TRANSPORTS:
        peers[transport] = [
            await Peer.create(
                PeerConfig(
                    run_id=f"security-{transport}",
                    stage=stage,
                    threads=1,
                    plaintext=transport == "plaintext",
                    rebalance=False,
                    log_every_s=0,
                    averaging=AveragingConfig(average=False),
                    dht=DHTConfig(initial_peers=tuple(boot)),
                ),
                run=run,
            )
            for stage in range(MODEL.num_stages)
            for _ in range(REPLICAS)
        ]
    return peers


async def measure(
    peers: dict[str, list[Peer]], run: RunConfig, rounds: int, microbatches: int
) -> list[dict]:
    pipelines = {}
    for transport, share in MODES:
        pipeline = Pipeline(
            peers[transport][0].directory,
            run,
            config=PipelineConfig(spot_check_share=share),
            seed=len(pipelines),
        )
        await pipeline.start()
        while any(len(pipeline.router.peers(k)) < REPLICAS for k in range(MODEL.num_stages)):
            await pipeline._next_refresh(timeout_s=1.0)
        pipelines[transport, share] = pipeline
    generator = torch.Generator().manual_seed(0)
    out = []
    try:
        for round_ in range(-1, rounds):  # round -1 warms every mode up and is not reported
            for mode in MODES[:: 1 if round_ % 2 == 0 else -1]:
                pipeline = pipelines[mode]
                checks_before = pipeline.spot_checks.counts.checked + (
                    pipeline.spot_checks.counts.inconclusive
                )
                cpu, wall = time.process_time(), time.perf_counter()
                for first in range(0, microbatches, IN_FLIGHT):
                    batch = [
                        torch.randint(0, 256, (MICROBATCH, MODEL.seq_len + 1), generator=generator)
                        for _ in range(first, min(first + IN_FLIGHT, microbatches))
                    ]
                    await asyncio.gather(
                        *(
                            pipeline.train_microbatch(f"r{round_}-{first + i}", tokens)
                            for i, tokens in enumerate(batch)
                        )
                    )
                await pipeline.spot_checks.settle()
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                checks = (
                    pipeline.spot_checks.counts.checked
                    + pipeline.spot_checks.counts.inconclusive
                    - checks_before
                )
                if round_ < 0:
                    continue
                out.append(
                    dict(
                        round=round_,
                        mode=mode,
                        cpu_ms=cpu / microbatches * 1e3,
                        wall_ms=wall / microbatches * 1e3,
                        checks=checks,
                    )
                )
                print(
                    f"round {round_} {label(mode)}: {out[-1]['cpu_ms']:.1f} CPU-ms and "
                    f"{out[-1]['wall_ms']:.1f} ms per microbatch, {checks} spot-checks",
                    flush=True,
                )
    finally:
        for pipeline in pipelines.values():
            await pipeline.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--microbatches", type=int, default=16, help="per mode and round (8 samples each)"
    )
    parser.add_argument(
        "--rounds", type=int, default=6, help="rounds of every mode, alternating order"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "security_cost.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    info = RunInfo(
        command=".venv/bin/python bench/security_cost.py" + "".join(f" {a}" for a in sys.argv[1:])
    )
    run = RunConfig(model=MODEL, codec="int8", target_batch_size=32)
    dht = start_dht(DHTConfig())
    loop = LoopThread("swarm-loop")
    peers: dict[str, list[Peer]] = {}
    try:
        peers = loop.run(start_peers(run, visible_addresses(dht)), timeout_s=600)
        results = loop.run(measure(peers, run, args.rounds, args.microbatches), timeout_s=7200)
    finally:
        for peer in [p for group in peers.values() for p in group]:
            with contextlib.suppress(Exception):
                loop.run(peer.shutdown(), timeout_s=60)
        loop.close()
        dht.shutdown()
    info.finish()

    baseline = {r["round"]: r for r in results if r["mode"] == MODES[0]}
    rows = [
        [
            r["round"],
            label(r["mode"]),
            f"{r['cpu_ms']:.1f}",
            f"{r['cpu_ms'] / baseline[r['round']]['cpu_ms']:.3f}",
            f"{r['wall_ms']:.1f}",
            r["checks"],
        ]
        for r in results
    ]
    table = markdown_table(
        [
            "round",
            "mode",
            "CPU-ms per microbatch",
            f"÷ {label(MODES[0])}, same round",
            "wall ms per microbatch",
            "spot-checks",
        ],
        rows,
    )
    summary = []
    for mode in MODES[1:]:
        ratios = [
            r["cpu_ms"] / baseline[r["round"]]["cpu_ms"] for r in results if r["mode"] == mode
        ]
        summary.append(
            f"- {label(mode)}: median CPU per microbatch {statistics.median(ratios):.3f}x the baseline's "
            f"(range {min(ratios):.3f}-{max(ratios):.3f}) over {len(ratios)} rounds"
        )
    info.extra.append(
        f"tiny preset, 2 stages x {REPLICAS} non-averaging peers per run, codec int8, 1 torch thread, all in this "
        f"process with the trainer's pipelines; {args.microbatches} microbatches of {MICROBATCH} per mode and "
        f"round, {IN_FLIGHT} in flight, after one warm-up round"
    )
    body = table + "\n\n" + "\n".join(summary)
    path = write_result(
        args.out, title="What TLS and spot-checks cost a training step", info=info, body=body
    )
    print("\n" + body + f"\n\nwritten to {path}")


if __name__ == "__main__":
    main()
