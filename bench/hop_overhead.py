"""Per-hop RPC overhead: one Forward round trip through a real peer over loopback gRPC, minus its compute.

Run from the repository root:  .venv/bin/python bench/hop_overhead.py
Prints a markdown table and writes it, with the environment, to bench/results/hop_overhead.md.

What is measured. A real peer (``Peer.create``: hivemind DHT, gRPC server, stage executor) serves the middle
stage of a 3-stage "transport probe" model whose activations cross the cut at width 256 (as in W1) but
whose inside is 8 wide (a bottleneck pair around one d=8 block), so compute is small next to the transfer.
A ``PeerClient`` sends a float32 (B, 128, 256) input with ``eval_only`` and reads back the (B, 128, 256)
output: the activation travels once each way. B = 8 is exactly W1's microbatch (1 MiB); larger B gives
16 MiB and 64 MiB (64 one-MiB chunks per direction: chunking at work). The peer's ``executor.forward`` is
timed around every call, so overhead = round trip - compute of that same call: encode, gRPC streaming,
decode and the thread hops on both sides. A bare grpc.aio echo of the same bytes (``raw gRPC``) gives the
floor that Python gRPC itself sets, so the difference is what swarm's transport adds.

Client and peer live in this one process on two event-loop threads (the peer's torch work on its own
worker thread): they share the GIL, and on a 2-core machine they share the cores, as two peers on one host
would. Across machines the two sides would run in parallel, so these numbers are an upper bound on CPU cost
per hop, and a lower bound on nothing network-related (loopback has no bandwidth limit to speak of).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpc  # noqa: E402
import torch  # noqa: E402
from common import RESULTS_DIR, RunInfo, markdown_table, percentile, write_result  # noqa: E402

from swarm.compression import CODEC_NAMES, get_codec  # noqa: E402
from swarm.config import RunConfig  # noqa: E402
from swarm.model import ModelConfig  # noqa: E402
from swarm.peer.config import PeerConfig  # noqa: E402
from swarm.peer.heap import bound_heap  # noqa: E402
from swarm.peer.lifecycle import Peer  # noqa: E402
from swarm.proto import PROTOCOL_VERSION  # noqa: E402
from swarm.proto import swarm_pb2 as pb  # noqa: E402
from swarm.transport.channel import GRPC_OPTIONS  # noqa: E402
from swarm.transport.client import PeerClient  # noqa: E402
from swarm.transport.security import (  # noqa: E402
    PeerAddress,
    open_channel,
    server_credentials,
)

SEQ_LEN, WIDTH = 128, 256  # activation shape (B, SEQ_LEN, WIDTH): W1's cut
BYTES_PER_SAMPLE = SEQ_LEN * WIDTH * 4  # float32: 128 KiB per sequence
PROBE_MODEL = ModelConfig(
    d_model=8, n_heads=1, n_layers=3, num_stages=3, seq_len=SEQ_LEN, bottleneck_dim=WIDTH
)
RUN_ID = "bench-hop"
STAGE = 1  # the middle stage: float activations in and out
RAW = "raw gRPC"  # the floor: bytes echoed by a bare grpc.aio server, no swarm code on either side
# the same over TLS with the peer's own certificate and key: the floor for a peer serving TLS (the default)
RAW_TLS = "raw gRPC TLS"
RAWS = (RAW, RAW_TLS)
CHUNK_BYTES = 1 << 20  # the transport's default segment size
ECHO_METHOD = "/bench.Echo/Stream"


@dataclass(frozen=True, kw_only=True)
class Case:
    size_mib: float  # float32 activation size, each way
    codec: str
    repeats: int  # timed round trips (after warmup)

    @property
    def batch(self) -> int:
        return round(self.size_mib * (1 << 20) / BYTES_PER_SAMPLE)


@dataclass
class Row:
    case: Case
    wire_mib: float  # encoded payload each way
    rtt_s: list[float]
    compute_s: list[float]

    @property
    def overhead_s(self) -> list[float]:
        return [r - c for r, c in zip(self.rtt_s, self.compute_s)]

    def cells(self) -> list[object]:
        ms = lambda values, q: f"{1e3 * percentile(values, q):.1f}"  # noqa: E731
        over_med = percentile(self.overhead_s, 50)
        moved_mb = 2 * self.case.size_mib * (1 << 20) / 1e6  # fp32 bytes in + out
        return [
            f"{self.case.size_mib:g} MiB (B={self.case.batch})",
            self.case.codec,
            f"{self.wire_mib:.2f}",
            len(self.rtt_s),
            ms(self.rtt_s, 50),
            ms(self.rtt_s, 90),
            ms(self.compute_s, 50),
            ms(self.overhead_s, 50),
            ms(self.overhead_s, 90),
            f"{moved_mb / over_med:,.0f}",
        ]


HEADERS = [
    "activation (each way)",
    "codec",
    "wire MiB each way",
    "calls",
    "round trip p50 ms",
    "p90 ms",
    "compute p50 ms",
    "overhead p50 ms",
    "overhead p90 ms",
    "fp32 MB/s (in+out / overhead p50)",
]


class LoopThread:
    """An event loop on its own thread, so the peer and the client each have one (as separate hosts would)."""

    def __init__(self, name: str):
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class ComputeTimer:
    """Wraps the peer's ``executor.forward`` to record, per microbatch id, the seconds it ran."""

    def __init__(self, executor):
        self.seconds: dict[str, float] = {}
        inner = executor.forward

        def timed(microbatch_id, x, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(microbatch_id, x, **kwargs)
            finally:
                self.seconds[microbatch_id] = time.perf_counter() - t0

        executor.forward = timed  # the service looks the method up on every call


async def round_trips(
    peer_address: PeerAddress,
    echo_endpoints: dict[str, PeerAddress],
    cases: list[Case],
    warmup: int,
) -> list[tuple[list[str], list[float], list[float]]]:
    """For each case (all of one size): (microbatch ids, round-trip seconds, compute seconds the peer's reply
    reported: ``ReplyMeta.compute_s``) of its timed calls.

    The cases take turns call by call (none, fp16, bf16, int8, raw gRPC, none, ...), so a burst of load from
    other processes hits every codec alike and their ratios stay comparable."""
    client = PeerClient(peer_address)
    results: list[tuple[list[str], list[float], list[float]]] = [([], [], []) for _ in cases]
    try:
        channels = {raw: open_channel(address) for raw, address in echo_endpoints.items()}
        try:
            echoes = {raw: channel.stream_stream(ECHO_METHOD) for raw, channel in channels.items()}
            # (B, T, W)
            inputs = [
                torch.randn(c.batch, SEQ_LEN, WIDTH, generator=torch.Generator().manual_seed(0))
                for c in cases
            ]
            for i in range(warmup + max(c.repeats for c in cases)):
                for case, x, (ids, rtts, reported) in zip(cases, inputs, results):
                    if i >= warmup + case.repeats:
                        continue
                    mb_id = f"{case.codec}-{case.size_mib:g}-{i}"
                    t0 = time.perf_counter()
                    compute_s = 0.0
                    if case.codec in RAWS:
                        await echo_call(echoes[case.codec], x)
                    else:
                        compute_s = await forward_call(client, case, mb_id, x)
                    rtt = time.perf_counter() - t0
                    if i >= warmup:
                        ids.append(mb_id)
                        rtts.append(rtt)
                        reported.append(compute_s)
        finally:
            for channel in channels.values():
                await channel.close()
    finally:
        await client.close()
    return results


async def forward_call(
    client: PeerClient, case: Case, microbatch_id: str, x: torch.Tensor
) -> float:
    """One eval-only Forward; returns the compute seconds the peer's reply reports."""
    meta = pb.RequestMeta(
        protocol_version=PROTOCOL_VERSION,
        run_id=RUN_ID,
        stage=STAGE,
        microbatch_id=microbatch_id,
        codec=case.codec,
        eval_only=True,
        num_samples=case.batch,
    )
    reply = await client.forward(meta, [("input", x)], get_codec(case.codec), timeout_s=120)
    if tuple(reply.tensors["output"].shape) != tuple(x.shape):
        raise RuntimeError(
            f"the peer answered shape {list(reply.tensors['output'].shape)} to {list(x.shape)}"
        )
    return reply.meta.compute_s


async def echo_call(echo, x: torch.Tensor) -> None:
    """Stream x's float32 bytes in 1 MiB chunks to the bare echo server and read them all back."""
    # the copy a sender makes anyway; the transport's encode does the same
    payload = x.numpy().tobytes()

    async def send():
        for start in range(0, len(payload), CHUNK_BYTES):
            yield payload[start : start + CHUNK_BYTES]

    received = sum([len(chunk) async for chunk in echo(send(), timeout=120)])
    if received != len(payload):
        raise RuntimeError(f"the echo server returned {received} of {len(payload)} bytes")


async def start_echo_server(
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, str]:
    """A bare grpc.aio server (same options as the peer's) that reads a whole stream of byte chunks, then
    streams them back, like a peer that must have its whole input before it can compute."""

    async def echo(request_iterator, context):
        chunks = [chunk async for chunk in request_iterator]
        for chunk in chunks:
            yield chunk

    server = grpc.aio.server(options=GRPC_OPTIONS)
    # No (de)serializers: messages are raw bytes, so this measures gRPC and HTTP/2 alone.
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)}
            ),
        )
    )
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, f"127.0.0.1:{port}"


def serve_peer_process(conn, peer_config: PeerConfig, run: RunConfig, raws: list[str]) -> None:
    """``--peer-process``: the peer and the echo servers in a process of their own, as on another host. Sends
    (the peer's address, the echo servers' addresses) through ``conn``, then serves until ``conn`` says stop."""
    logging.basicConfig(level=logging.WARNING)
    # a spawned child inherits "spawn" as its start method; the peer's DHT process forks, as in `swarm peer`
    multiprocessing.set_start_method("fork", force=True)
    bound_heap()
    loop = LoopThread("peer-loop")
    servers = []
    peer = loop.run(Peer.create(peer_config, run=run))
    try:
        endpoints = {}
        for raw in raws:
            tls = raw == RAW_TLS
            credentials = server_credentials(peer.identity, peer.tls_cert) if tls else None
            server, endpoint = loop.run(start_echo_server(credentials))
            servers.append(server)
            endpoints[raw] = PeerAddress(endpoint, "", peer.tls_cert if tls else "")
        conn.send((peer.address, endpoints))
        conn.recv()  # stop
    finally:
        for server in servers:
            loop.run(server.stop(1.0))
        with contextlib.suppress(Exception):
            loop.run(peer.shutdown(), timeout_s=60)
        loop.close()


def wire_mib(case: Case) -> float:
    if case.codec in RAWS:
        return case.size_mib
    flat = torch.randn(case.batch * SEQ_LEN * WIDTH, generator=torch.Generator().manual_seed(0))
    return len(get_codec(case.codec).encode(flat)) / (1 << 20)


def build_cases(args) -> list[Case]:
    codecs = [c for c in args.codecs.split(",") if c]
    unknown = sorted(set(codecs) - set(CODEC_NAMES) - set(RAWS))
    if unknown:
        raise SystemExit(
            f"unknown codecs {unknown}; swarm.compression.CODEC_NAMES = {list(CODEC_NAMES)}"
        )
    # one sequence: the fixed cost per call
    sizes = {float(s) for s in args.sizes.split(",") if s}
    cases = [
        Case(size_mib=0.125, codec=c, repeats=args.repeats) for c in ("none", *RAWS) if c in codecs
    ]
    cases += [Case(size_mib=1, codec=c, repeats=args.repeats) for c in codecs]
    cases += [Case(size_mib=16, codec=c, repeats=max(5, args.repeats // 3)) for c in codecs]
    cases = [c for c in cases if c.size_mib in sizes]
    if args.big_mib:
        cases.append(Case(size_mib=args.big_mib, codec="none", repeats=max(3, args.repeats // 15)))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=100, help="timed calls per 1 MiB case (a third for 16 MiB)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before each case")
    parser.add_argument(
        "--codecs",
        default=",".join([*CODEC_NAMES, *RAWS]),
        help=f"comma-separated codec names; '{RAW}' = the bare gRPC floor, '{RAW_TLS}' the same over TLS",
    )
    parser.add_argument(
        "--sizes",
        default="0.125,1,16",
        help="comma-separated activation sizes in MiB among 0.125, 1 and 16 (--big-mib adds one more)",
    )
    parser.add_argument(
        "--big-mib", type=int, default=64, help="one larger size with codec none (0 = skip)"
    )
    parser.add_argument(
        "--plaintext",
        action="store_true",
        help="serve the peer without TLS (PeerConfig.plaintext); the default serves TLS, as peers do",
    )
    parser.add_argument(
        "--peer-process",
        action="store_true",
        help="run the peer (and the echo servers) in a process of its own instead of this one; compute is "
        "then what the peer's reply reports (ReplyMeta.compute_s)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "hop_overhead.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    bound_heap()  # the heap settings of a peer process (`swarm peer` sets them)
    command = ".venv/bin/python bench/hop_overhead.py" + "".join(
        f" {shlex.quote(a)}" for a in sys.argv[1:]
    )
    info = RunInfo(command=command)
    cases = build_cases(args)
    peer_config = PeerConfig(
        run_id=RUN_ID,
        stage=STAGE,
        threads=1,
        max_microbatch_size=max(c.batch for c in cases),
        plaintext=args.plaintext,
    )
    # eval_only calls never step anyway
    run = RunConfig(model=PROBE_MODEL, target_batch_size=1 << 30)

    raws = [
        raw
        for raw in RAWS
        if raw in args.codecs.split(",") and not (raw == RAW_TLS and args.plaintext)
    ]
    cases = [c for c in cases if c.codec not in RAWS or c.codec in raws]
    client_loop = LoopThread("client-loop")
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        stack.callback(client_loop.close)
        if args.peer_process:
            # the client's codec work on one torch thread, as in one process (where PeerConfig.threads sets it)
            torch.set_num_threads(peer_config.threads)
            context = multiprocessing.get_context("spawn")
            conn, child_conn = context.Pipe()
            process = context.Process(
                target=serve_peer_process, args=(child_conn, peer_config, run, raws)
            )
            process.start()
            stack.callback(process.join, 90)
            stack.callback(conn.send, "stop")
            peer_address, echo_endpoints = conn.recv()
            timer = None
        else:
            server_loop = LoopThread("peer-loop")
            stack.callback(server_loop.close)
            peer = server_loop.run(Peer.create(peer_config, run=run))
            stack.callback(server_loop.run, peer.shutdown(), 60)
            peer_address, timer, echo_endpoints = peer.address, ComputeTimer(peer.executor), {}
            for raw in raws:
                tls = raw == RAW_TLS
                credentials = server_credentials(peer.identity, peer.tls_cert) if tls else None
                server, endpoint = server_loop.run(start_echo_server(credentials))
                stack.callback(server_loop.run, server.stop(1.0))
                echo_endpoints[raw] = PeerAddress(endpoint, "", peer.tls_cert if tls else "")
        print(
            f"peer serves stage {STAGE} of the probe model at {peer_address.endpoint}; {len(cases)} cases",
            flush=True,
        )
        # sizes in order; codecs interleaved within
        for size in dict.fromkeys(c.size_mib for c in cases):
            group = [c for c in cases if c.size_mib == size]
            measured = client_loop.run(
                round_trips(peer_address, echo_endpoints, group, args.warmup)
            )
            for case, (ids, rtts, reported) in zip(group, measured):
                if case.codec in RAWS:
                    compute = [0.0] * len(ids)
                elif timer is None:
                    compute = reported
                else:
                    compute = [timer.seconds[i] for i in ids]
                rows.append(Row(case, wire_mib(case), rtts, compute))
                print(markdown_table(HEADERS, [rows[-1].cells()]).splitlines()[-1], flush=True)
    info.finish()

    info.extra += [
        "torch threads: peer compute 1 (PeerConfig.threads); encode/decode on the event loop for a tensor of "
        "one segment (1 MiB), on each loop's default thread pool for several segments of >= 256 KiB",
        "client and peer in two processes (--peer-process), loopback gRPC"
        if args.peer_process
        else "client and peer in one process, two event-loop threads (uvloop), loopback gRPC",
        "peer serves " + ("plaintext (--plaintext)" if args.plaintext else "TLS (the default)"),
    ]
    table = markdown_table(HEADERS, [row.cells() for row in rows], right_align_from=2)
    one = {r.case.codec: r for r in rows if r.case.size_mib == 1}
    notes = [
        "Peer: `Peer.create` in this process (real hivemind DHT, real gRPC server, real executor) serving "
        f"the middle stage of a probe model ({PROBE_MODEL.d_model}-wide block between {WIDTH}-wide "
        "bottleneck Linears), so the activation shape is W1's cut: (B, 128, 256) float32 = B x 128 KiB.",
        "Each call is a `Forward` with `eval_only`: the input travels to the peer and the output "
        "(same shape) travels back, both in the call's codec. compute = the peer's `executor.forward` "
        "timed around that same call; overhead = round trip - compute (encode, chunked gRPC streaming, "
        "decode, thread hops on both sides). MB/s = 10^6 bytes of float32 activation moved (in + out) "
        "per second of median overhead.",
        "Client and peer share this process's GIL and the 2 cores, so the two sides of a hop do not run "
        "in parallel as they would on two hosts: read these as the CPU cost of a hop, not a network limit.",
        f"`{RAW}`: the same float32 bytes in 1 MiB chunks echoed (all received, then all sent back) by a bare "
        "grpc.aio server with the peer's channel options and no swarm code: no protobuf frames, codec, "
        "validation, thread hops or compute. It is the floor for this Python gRPC stack; swarm's overhead "
        "above it is what the transport itself adds.",
        f"`{RAW_TLS}`: the same echo over TLS, served with the peer's own key and certificate and dialled "
        "with the peer's channel (`open_channel`, the certificate pinned): the floor for a peer that serves "
        "TLS, as peers do unless started with --plaintext.",
    ]
    if "none" in one and percentile(one["none"].overhead_s, 50) > 0:
        base = percentile(one["none"].overhead_s, 50)
        ratios = ", ".join(
            f"{c} {percentile(r.overhead_s, 50) / base:.2f}x" for c, r in one.items() if c != "none"
        )
        notes.append(f"1 MiB overhead relative to codec none, same run: {ratios}.")
    for raw in RAWS:
        if raw not in one or percentile(one[raw].overhead_s, 50) <= 0:
            continue
        floor = percentile(one[raw].overhead_s, 50)
        ratios = ", ".join(
            f"{c} {percentile(r.overhead_s, 50) / floor:.2f}x"
            for c, r in one.items()
            if c not in RAWS
        )
        same = (raw == RAW_TLS) != args.plaintext
        notes.append(
            f"1 MiB overhead relative to {raw}"
            + (" (the same stack as the peer's: the issue's bound, <= 1.5x)" if same else "")
            + f", same run: {ratios}."
        )
    body = "\n".join([table, "", *(f"- {n}" for n in notes)])
    path = write_result(
        args.out, title="Per-hop RPC overhead (loopback gRPC, one real peer)", info=info, body=body
    )
    print("\n" + table + "\n\n" + "\n".join(notes) + f"\n\nwritten to {path}")


if __name__ == "__main__":
    main()
