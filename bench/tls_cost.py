"""What TLS and caller authentication cost a call: the same stage served by two peers, one over TLS (the default)
and one with ``--plaintext``, called in turns with the same requests.

Run from the repository root:  .venv/bin/python bench/tls_cost.py [--calls 40]
Writes bench/results/tls_cost.md.

Both peers run in this process, on one event loop thread, and the client on another (as separate hosts would); each
serves the middle stage of a 3-stage model (d=256, T=128), so a forward carries (B, T, 256) float32 activations each
way: B=8 is 1 MiB, B=32 4 MiB. Calls alternate TLS, plaintext, TLS, ..., so load from other processes hits both
alike. Every call carries a caller token either way (the peer checks the signature once per token and caches it),
so the plaintext peer's numbers include authentication and the difference is what encryption costs. ``Info`` is a
round trip with no payload and no compute: the fixed cost of a call.
"""

from __future__ import annotations

import argparse
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

from swarm.compression import get_codec  # noqa: E402
from swarm.config import RunConfig  # noqa: E402
from swarm.model import ModelConfig  # noqa: E402
from swarm.peer.config import PeerConfig  # noqa: E402
from swarm.peer.lifecycle import Peer  # noqa: E402
from swarm.proto import PROTOCOL_VERSION  # noqa: E402
from swarm.proto import swarm_pb2 as pb  # noqa: E402
from swarm.transport.client import PeerClient  # noqa: E402

MODEL = ModelConfig(d_model=256, n_heads=4, n_layers=3, seq_len=128, num_stages=3)
STAGE = 1
BATCHES = (8, 32)
NONE = get_codec("none")
HEADERS = ["call", "MiB each way", "TLS median ms", "plaintext median ms", "TLS ÷ plaintext"]


async def timed_calls(clients: dict[str, PeerClient], run_ids: dict[str, str], calls: int):
    """{(case, mode): [seconds]} for Info and eval-only forwards, modes taking turns call by call."""
    out: dict[tuple[str, str], list[float]] = {}
    inputs = {b: torch.randn(b, MODEL.seq_len, MODEL.d_model) for b in BATCHES}  # (B, T, D)
    for i in range(calls + 2):  # the first two of each are warm-up
        for mode, client in clients.items():
            started = time.perf_counter()
            await client.info(run_ids[mode], timeout_s=30)
            if i >= 2:
                out.setdefault(("Info", mode), []).append(time.perf_counter() - started)
            for b, x in inputs.items():
                meta = pb.RequestMeta(
                    protocol_version=PROTOCOL_VERSION,
                    run_id=run_ids[mode],
                    stage=STAGE,
                    microbatch_id=f"{mode}-{b}-{i}",
                    codec="none",
                    num_samples=b,
                    eval_only=True,
                )
                started = time.perf_counter()
                await client.forward(meta, [("input", x)], NONE, timeout_s=60)
                if i >= 2:
                    out.setdefault((f"forward B={b}", mode), []).append(
                        time.perf_counter() - started
                    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="timed calls per case and mode")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "tls_cost.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    info = RunInfo(
        command=".venv/bin/python bench/tls_cost.py" + "".join(f" {a}" for a in sys.argv[1:])
    )
    run = RunConfig(model=MODEL, target_batch_size=1 << 30)  # eval-only calls never step anyway
    run_ids = {"TLS": "tls-cost-tls", "plaintext": "tls-cost-plain"}
    server_loop, client_loop = LoopThread("peer-loop"), LoopThread("client-loop")
    peers: dict[str, Peer] = {}
    try:
        for mode, plaintext in (("TLS", False), ("plaintext", True)):
            config = PeerConfig(
                run_id=run_ids[mode],
                stage=STAGE,
                threads=1,
                plaintext=plaintext,
                rebalance=False,
                log_every_s=0,
                max_microbatch_size=max(BATCHES),
            )
            peers[mode] = server_loop.run(Peer.create(config, run=run))

        async def measure():
            clients = {mode: PeerClient(peer.address) for mode, peer in peers.items()}
            try:
                return await timed_calls(clients, run_ids, args.calls)
            finally:
                for client in clients.values():
                    await client.close()

        times = client_loop.run(measure(), timeout_s=3600)
    finally:
        for peer in peers.values():
            with contextlib.suppress(Exception):
                server_loop.run(peer.shutdown(), timeout_s=60)
        client_loop.close()
        server_loop.close()
    info.finish()

    rows = []
    for case in dict.fromkeys(case for case, _ in times):
        tls = statistics.median(times[case, "TLS"]) * 1e3
        plain = statistics.median(times[case, "plaintext"]) * 1e3
        mib = 0 if case == "Info" else int(case.split("=")[1]) * MODEL.seq_len * 256 * 4 / 2**20
        rows.append([case, f"{mib:g}", f"{tls:.2f}", f"{plain:.2f}", f"{tls / plain:.3f}"])
        print(markdown_table(HEADERS, [rows[-1]]).splitlines()[-1], flush=True)
    info.extra.append(
        f"{args.calls} timed calls per row and mode (after 2 warm-up), modes alternating; peer compute on 1 torch "
        f"thread; both peers in this process (one event loop thread), the client on another"
    )
    body = markdown_table(HEADERS, rows)
    path = write_result(args.out, title="What TLS costs a call", info=info, body=body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
