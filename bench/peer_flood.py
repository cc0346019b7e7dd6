"""A peer's memory under a flood of hostile requests: peak RSS against its configured budgets (issue 12).

Run from the repository root:  .venv/bin/python bench/peer_flood.py
Prints a markdown table and writes it, with the environment, to bench/results/peer_flood.md (about 4 minutes).

What is measured. A real bootstrap DHT node and one real ``swarm peer`` process (``--preset w1 --stage 1`` of
the 2-stage W1 run, ``--threads 1``) are started with ``ProcessGroup``, once per ``--request-memory-bytes``
setting (default 1 GiB, then 128 MiB). Stage 1 is the stage with the largest requests: its input is a
(B, 128, 256) float32 activation, 32 MiB at the peer's default ``--max-microbatch-size`` of 256, where stage 0
takes only token ids (256 KiB). After two normal calls (warm-up), the peer's RSS at rest is read, then
client processes (separate from the peer and from this script, speaking raw gRPC frames as an attacker
would) run these phases one after the other:

- ``one max call``: one largest request at a time (B = 256, full sequence, ``eval_only``): the memory one
  admitted call costs (its 32 MiB request and the compute's working set), the reference for the bound.
- ``(a) huge headers``: streams that send a request frame and one tensor header claiming a huge tensor
  (2^20 samples, 2^20 tokens, 2^20 wide, 2^62 elements, a wrong dtype, ...) and then stay open: the answer
  can only come from the header, so it shows the peer refuses before allocating.
- ``(b) max requests``: many streams at once, each sending the largest request the peer accepts in full and,
  whatever the answer, the next one at once, for ``--flood-s`` seconds: far more than
  ``--request-memory-bytes`` admits at a time (32.25 MiB each: 31 fit in 1 GiB, 3 in 128 MiB).
- ``(c) idle streams``: many streams that stop sending: half after all but the last chunk of a largest input
  (31 of 32 MiB received and allocated), half right after their request frame; the peer cuts them after
  ``--read-idle-s`` (shortened to 5 s here from the default 30 s to keep the run short).
- ``(d) garbage``: streams of random bytes (64 B to 4 MiB messages, and some over the 16 MiB message cap).

Every client counts its calls' answers by gRPC status (RESOURCE_EXHAUSTED split by which budget refused it,
from the peer's sentence; DEADLINE_EXCEEDED split into the peer's read deadline and the client's own
deadline). The peak RSS of a phase is the peer process's ``VmHWM`` after ``clear_refs`` reset it at the
start of the phase (the exact kernel-tracked peak), and the process tree's (the peer, its hivemind DHT
process and p2pd) is sampled every 50 ms. At the end, a normal trainer call (``compute_loss`` Forward with
commit, W1's microbatch of 8) must still be served.

The bound checked. The budget bounds request tensors held at once; one compute thread adds one call's
working set; gRPC buffers up to a receive window for each call it keeps open, refused or not, and keeps at most
``--max-open-calls``; so a phase's peak rise over rest should stay under budget + the ``one max call`` rise +
open calls x window, plus slack for the allocator (``SLACK_MIB``). The per-caller stream limit (64 by default) also
binds: every client runs on 127.0.0.1, so all clients are one caller, as one attacking host would be.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpc  # noqa: E402
from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402

from swarm.peer.config import LimitsConfig  # noqa: E402
from swarm.proto import PROTOCOL_VERSION  # noqa: E402
from swarm.proto import swarm_pb2 as pb  # noqa: E402
from swarm.transport.channel import GRPC_OPTIONS, MAX_MESSAGE_BYTES  # noqa: E402

PRESET, STAGE, NUM_STAGES = "w1", 1, 2
MAX_BATCH, SEQ_LEN, WIDTH = (
    256,
    128,
    256,
)  # the peer's default --max-microbatch-size; W1's seq_len and cut
CHUNK_BYTES = 1 << 20  # the transport's default segment size
INPUT_BYTES = MAX_BATCH * SEQ_LEN * WIDTH * 4  # (B, T, D) float32: 32 MiB
TARGET_BYTES = MAX_BATCH * SEQ_LEN * 8  # (B, T) int64: 256 KiB
ONE_CALL_REPEATS = 3  # largest calls in a row in the reference phase
SLACK_MIB = 64  # gRPC/HTTP2 buffers and allocator slack allowed above budget + one call
FORWARD = "/swarm.v1.StagePeer/Forward"
RESULT = "RESULT "  # a client's last line: RESULT {json}
MiB = 1 << 20


# ------------------------------------------------------------------------------------------------ clients
# A client is this script run with --client SPEC: grpc and the generated messages only (no torch, so it
# starts in a fraction of a second), many asyncio streams over a few connections.


def header(
    name: str, shape, dtype: str = "float32", segment_numel: int = CHUNK_BYTES // 4
) -> pb.Frame:
    return pb.Frame(
        tensor=pb.TensorHeader(
            name=name, dtype=dtype, shape=list(shape), codec="none", segment_numel=segment_numel
        )
    )


# (a): each header claims more than the peer may allocate for stage 1, in one way or another.
HUGE_HEADERS = [
    header("input", (1 << 20, SEQ_LEN, WIDTH)),  # 32 GiB: samples past --max-microbatch-size
    header("input", (MAX_BATCH, 1 << 20, WIDTH)),  # 256 GiB: tokens past the model's seq_len
    header("input", (MAX_BATCH, SEQ_LEN, 1 << 20)),  # 128 GiB: wider than the stage's input
    header("input", (1 << 31, 1 << 31)),  # 2^62 elements
    header("input", (MAX_BATCH, SEQ_LEN, WIDTH), dtype="float64"),  # a wrong dtype (64 MiB)
    header("input", (MAX_BATCH, SEQ_LEN, WIDTH, 1 << 16)),  # a wrong rank, 2 TiB
    header("targets", (1 << 24, SEQ_LEN), dtype="int64"),  # targets first, 16 GiB
    header(
        "input", (MAX_BATCH, SEQ_LEN, WIDTH), segment_numel=1 << 40
    ),  # a chunk past the message cap
]


def request_frame(run_id: str, microbatch_id: str) -> pb.Frame:
    return pb.Frame(
        request=pb.RequestMeta(
            protocol_version=PROTOCOL_VERSION,
            run_id=run_id,
            stage=STAGE,
            microbatch_id=microbatch_id,
            codec="none",
            eval_only=True,
            num_tensors=2,
            num_samples=MAX_BATCH,
        )
    )


def max_request_frames() -> list[pb.Frame]:
    """The largest request stage 1 accepts, without its request frame: a (256, 128, 256) float32 input and
    (256, 128) int64 targets, all zeros (valid values), in 1 MiB chunks as the transport sends them."""
    chunk = pb.Frame(chunk=bytes(CHUNK_BYTES))
    frames = [header("input", (MAX_BATCH, SEQ_LEN, WIDTH))]
    frames += [chunk] * (INPUT_BYTES // CHUNK_BYTES)
    frames += [
        header("targets", (MAX_BATCH, SEQ_LEN), dtype="int64", segment_numel=CHUNK_BYTES // 8)
    ]
    frames += [pb.Frame(chunk=bytes(TARGET_BYTES))]
    return frames


def label(error: grpc.aio.AioRpcError) -> str:
    """A status code name, refined by the peer's sentence where one code has several causes."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        for flag, what in (
            ("--max-streams-per-caller", "streams"),
            ("--request-memory-bytes", "memory"),
            ("--max-queued-calls", "queue"),
        ):
            if flag in details:
                return f"RESOURCE_EXHAUSTED ({what})"
        if "larger than max" in details:
            return "RESOURCE_EXHAUSTED (message cap)"
        return "RESOURCE_EXHAUSTED (other)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (
            "DEADLINE_EXCEEDED ("
            + ("peer read" if "--read-" in details else "client deadline")
            + ")"
        )
    return code.name


async def one_call(
    method, frames, *, hold: asyncio.Event | None, timeout_s: float
) -> tuple[str, str]:
    """Send ``frames`` (then, with ``hold``, keep the stream open and silent until it is set); the answer's
    label and the peer's sentence."""

    async def gen():
        for frame in frames:
            yield frame
        if hold is not None:
            await hold.wait()

    try:
        async for _ in method(gen(), timeout=timeout_s):
            pass
    except grpc.aio.AioRpcError as e:
        return label(e), e.details() or ""
    return "OK", ""


async def client_main(spec: dict) -> dict:
    kind, run_id, streams = spec["kind"], spec["run_id"], spec["streams"]
    options = [*GRPC_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
    if kind == "garbage":  # the sender's own cap must not stop messages bigger than the peer's
        options = [(k, v) for k, v in options if k != "grpc.max_send_message_length"]
        options.append(("grpc.max_send_message_length", -1))
    from swarm.identity import Identity
    from swarm.transport.callers import CallerToken
    from swarm.transport.security import PeerAddress, open_channel

    # each flood client is a caller with a valid identity: the flood is on the peer's bounds, not its door
    address = PeerAddress(spec["endpoint"], spec["peer_id"], spec["tls_cert"])
    token = CallerToken(Identity.ephemeral())

    def signed(method):
        return lambda requests, timeout: method(
            requests, timeout=timeout, metadata=token.metadata(address.peer_id)
        )

    channels = [open_channel(address, options) for _ in range(spec["channels"])]
    framed = [
        signed(
            c.stream_stream(
                FORWARD,
                request_serializer=pb.Frame.SerializeToString,
                response_deserializer=pb.Frame.FromString,
            )
        )
        for c in channels
    ]
    raw = [
        signed(c.stream_stream(FORWARD, request_serializer=None, response_deserializer=None))
        for c in channels
    ]
    counts: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}  # one sentence per label, for the report

    def count(answer: tuple[str, str]) -> None:
        counts[answer[0]] += 1
        examples.setdefault(answer[0], answer[1][:300])

    hold = asyncio.Event()
    deadline = time.monotonic() + spec["seconds"]
    prefix = f"{kind}-{os.getpid()}"
    body = max_request_frames()
    rng = random.Random(spec["seed"])

    async def stream(i: int) -> None:
        method = framed[i % len(framed)]
        n = 0
        while True:
            mb = f"{prefix}-{i}-{n}"
            if kind == "huge":
                frames = [request_frame(run_id, mb), HUGE_HEADERS[(i + n) % len(HUGE_HEADERS)]]
                count(await one_call(method, frames, hold=hold, timeout_s=30))
            elif kind == "max":
                frames = [request_frame(run_id, mb), *body]
                count(await one_call(method, frames, hold=None, timeout_s=spec["call_timeout_s"]))
            elif kind == "idle":
                # half stop after all but the last chunk of the input, half after the request frame
                frames = [
                    request_frame(run_id, mb),
                    *(body[: INPUT_BYTES // CHUNK_BYTES] if i % 2 == 0 else []),
                ]
                count(await one_call(method, frames, hold=hold, timeout_s=spec["call_timeout_s"]))
                return
            elif kind == "garbage":
                sizes = [
                    rng.choice([64, 64 << 10, 1 << 20, 4 << 20]) for _ in range(rng.randint(1, 3))
                ]
                if rng.random() < 0.1:
                    sizes = [MAX_MESSAGE_BYTES + (4 << 20)]  # past the peer's message cap
                frames = [rng.randbytes(size) for size in sizes]
                count(await one_call(raw[i % len(raw)], frames, hold=None, timeout_s=30))
            n += 1
            if n >= spec["calls_per_stream"] or time.monotonic() > deadline:
                return

    async def release() -> None:
        await asyncio.sleep(
            spec["hold_s"]
        )  # idle streams: the peer should have cut them long before
        hold.set()

    releaser = asyncio.ensure_future(release())
    try:
        await asyncio.gather(*(stream(i) for i in range(streams)))
    finally:
        releaser.cancel()
    hold.set()
    for c in channels:
        await c.close(grace=None)
    return {"counts": dict(counts), "examples": examples}


# ------------------------------------------------------------------------------------------------ memory


def status_kib(pid: int, key: str) -> int:
    """``key`` (VmRSS, VmHWM) of process ``pid`` in KiB; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (the DHT process, p2pd), from /proc/*/stat."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, ppid in parent.items() if ppid in frontier]
        tree += frontier
    return tree


class RssMonitor:
    """The peer's peak RSS per phase: its VmHWM after ``clear_refs`` reset it (exact), and the tree's RSS
    sampled every 50 ms (the peer's children hardly move, but the issue asks for the whole tree)."""

    def __init__(self, pid: int):
        self.pid, self.tree = pid, descendants(pid)
        self.tree_peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss", daemon=True)
        self._thread.start()

    def tree_kib(self) -> int:
        return sum(status_kib(p, "VmRSS") for p in self.tree)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.tree_peak_kib = max(self.tree_peak_kib, self.tree_kib())

    def reset(self) -> None:
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        self.tree_peak_kib = self.tree_kib()

    def peer_rss_mib(self) -> float:
        return status_kib(self.pid, "VmRSS") / 1024

    def peer_peak_mib(self) -> float:
        return status_kib(self.pid, "VmHWM") / 1024

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ------------------------------------------------------------------------------------------------ driver


@dataclass
class Phase:
    name: str
    budget_mib: float
    counts: dict[str, int]
    peak_rise_mib: float  # the peer process's VmHWM over its rest RSS
    tree_rise_mib: float  # the sampled tree RSS peak over the tree's rest RSS
    after_mib: float  # the peer's RSS over rest once the phase ended (kept by the allocator)
    seconds: float
    start_mib: float = (
        0.0  # the peer's RSS over rest when the phase began (kept from earlier phases)
    )
    examples: dict[str, str] = field(default_factory=dict)  # label -> one sentence the client got
    extra: str = ""

    @property
    def sent(self) -> int:
        return sum(self.counts.values())


@dataclass
class BudgetRun:
    budget_bytes: int
    windows_mib: float  # the peer's --max-open-calls x --stream-window-bytes: what gRPC may buffer for open calls
    rest_mib: float = 0.0
    tree_rest_mib: float = 0.0
    phases: list[Phase] = field(default_factory=list)
    after: str = ""  # the normal call after the flood

    @property
    def budget_mib(self) -> float:
        return self.budget_bytes / MiB

    @property
    def one_call_mib(self) -> float:
        return next(p.peak_rise_mib for p in self.phases if p.name == "one max call")

    def allowance_mib(self) -> float:
        return self.budget_mib + self.one_call_mib + self.windows_mib + SLACK_MIB


async def normal_call(address, run_id: str, microbatch_id: str) -> str:
    """A trainer's call at the last stage: compute_loss Forward of W1's microbatch, then its commit."""
    import torch

    from swarm.compression import get_codec
    from swarm.transport.client import PeerClient

    client = PeerClient(address)
    started = time.perf_counter()
    try:
        meta = pb.RequestMeta(
            protocol_version=PROTOCOL_VERSION,
            run_id=run_id,
            stage=STAGE,
            microbatch_id=microbatch_id,
            codec="none",
            compute_loss=True,
            num_samples=8,
        )
        x, targets = torch.randn(8, SEQ_LEN, WIDTH), torch.randint(0, 256, (8, SEQ_LEN))
        reply = await client.forward(
            meta, [("input", x), ("targets", targets)], get_codec("none"), timeout_s=60
        )
        await reply.committed
        return f"OK (loss {reply.meta.loss:.2f}, {time.perf_counter() - started:.2f}s)"
    except Exception as e:  # the point is to report it, not to stop the benchmark
        return f"FAILED: {type(e).__name__}: {e}"
    finally:
        await client.close()


async def max_in_flight_while(address, run_id: str, clients_done) -> int:
    """The largest ``in_flight`` the peer announces (Info) while ``clients_done()`` is false."""
    from swarm.transport.client import PeerClient

    client, most = PeerClient(address), 0
    try:
        while not clients_done():
            try:
                most = max(most, (await client.info(run_id, timeout_s=5)).in_flight)
            except Exception:
                pass  # refused (streams per caller) or slow: the next poll counts
            await asyncio.sleep(0.5)
    finally:
        await client.close()
    return most


def run_clients(
    group, name: str, spec: dict, *, clients: int, timeout_s: float, poll=None
) -> tuple[dict, object]:
    """Start ``clients`` client processes with ``spec``; wait for them all; their summed answer counts (and
    what ``poll(done)`` returned, run meanwhile on this thread)."""
    procs = [
        group.start(
            f"{name}-{i}",
            [sys.executable, __file__, "--client", json.dumps({**spec, "seed": i})],
            env={"OMP_NUM_THREADS": "1"},
        )
        for i in range(clients)
    ]
    polled = None
    if poll is not None:
        polled = asyncio.run(poll(lambda: all(not p.alive() for p in procs)))
    counts: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    for proc in procs:
        result = json.loads(proc.wait_for("^" + RESULT + "(.*)$", timeout_s=timeout_s).group(1))
        counts.update(result["counts"])
        examples = {**result["examples"], **examples}
    return dict(counts), examples, polled


def run_budget(group, addr_file: Path, budget_bytes: int, args) -> BudgetRun:
    from swarm.coordinator.localswarm import start_peer, wait_ready
    from swarm.transport.security import address_by_handshake

    tag = f"{budget_bytes // MiB}mib"
    run_id = f"flood-{tag}"
    run_flags = [
        *("--preset", PRESET, "--target-batch-size", 1 << 20, "--no-rebalance", "--no-average"),
        *(
            "--log-every-s",
            0,
            "--request-memory-bytes",
            budget_bytes,
            "--read-idle-s",
            args.read_idle_s,
            "--stream-window-bytes",
            args.window_bytes,
        ),
    ]
    peer = start_peer(
        group, f"peer-{tag}", stage=STAGE, run_id=run_id, addr_file=addr_file, run_flags=run_flags
    )
    endpoint = wait_ready(peer)
    address = address_by_handshake(endpoint)  # the bench's own peer: certificate from the handshake
    limits = LimitsConfig()
    result = BudgetRun(budget_bytes, windows_mib=limits.max_open_calls * args.window_bytes / MiB)
    print(
        f"budget {budget_bytes / MiB:.0f} MiB: peer {peer.pid} serves stage {STAGE} at {endpoint}",
        flush=True,
    )
    for i in range(2):  # warm-up: first-call allocations are part of the peer's rest state
        warm = asyncio.run(normal_call(address, run_id, f"warm-{i}"))
        if not warm.startswith("OK"):
            raise RuntimeError(f"the peer does not serve a normal call before the flood: {warm}")
    monitor = RssMonitor(peer.pid)
    try:
        result.rest_mib, result.tree_rest_mib = monitor.peer_rss_mib(), monitor.tree_kib() / 1024
        base = {
            "endpoint": endpoint,
            "peer_id": address.peer_id,
            "tls_cert": address.tls_cert,
            "run_id": run_id,
            "channels": 4,
            "hold_s": 0.0,
            "call_timeout_s": 30.0,
        }
        phases = [
            (
                "one max call",
                1,
                {"kind": "max", "streams": 1, "calls_per_stream": ONE_CALL_REPEATS, "seconds": 1e9},
            ),
            (
                "(a) huge headers",
                args.clients,
                {
                    "kind": "huge",
                    "streams": args.streams,
                    "calls_per_stream": 10,
                    "seconds": 1e9,
                    "hold_s": 60.0,
                },
            ),
            (
                "(b) max requests",
                args.clients,
                {
                    "kind": "max",
                    "streams": args.streams,
                    "calls_per_stream": 1 << 30,
                    "seconds": args.flood_s,
                    "call_timeout_s": 180.0,
                },
            ),
            (
                "(c) idle streams",
                args.clients,
                {
                    "kind": "idle",
                    "streams": args.streams,
                    "calls_per_stream": 1,
                    "seconds": 1e9,
                    "hold_s": args.read_idle_s + 30,
                    "call_timeout_s": args.read_idle_s + 60,
                },
            ),
            (
                "(d) garbage",
                args.clients,
                {"kind": "garbage", "streams": args.streams, "calls_per_stream": 5, "seconds": 1e9},
            ),
        ]
        for name, clients, spec in phases:
            lines_before = len(peer.lines)
            start_mib = monitor.peer_rss_mib() - result.rest_mib
            monitor.reset()
            started = time.monotonic()
            poll = None
            if spec["kind"] == "idle":
                poll = lambda done: max_in_flight_while(address, run_id, done)  # noqa: E731
            counts, examples, polled = run_clients(
                group,
                f"{name[:3].strip('() ')}-{tag}",
                {**base, **spec},
                clients=clients,
                timeout_s=400,
                poll=poll,
            )
            seconds = time.monotonic() - started
            extra = []
            if polled is not None:
                extra.append(f"most in_flight announced while idle streams were open: {polled}")
            if spec["kind"] == "garbage":
                logged = peer.lines[lines_before:]
                parsed = sum("could not be parsed" in line for line in logged)
                tracebacks = sum("Traceback" in line for line in logged)
                extra.append(
                    f"peer log: {parsed} line(s) about unparsable frames, {tracebacks} traceback(s)"
                )
            phase = Phase(
                name=name,
                budget_mib=result.budget_mib,
                counts=counts,
                peak_rise_mib=monitor.peer_peak_mib() - result.rest_mib,
                tree_rise_mib=monitor.tree_peak_kib / 1024 - result.tree_rest_mib,
                after_mib=monitor.peer_rss_mib() - result.rest_mib,
                seconds=seconds,
                start_mib=start_mib,
                examples=examples,
                extra="; ".join(extra),
            )
            result.phases.append(phase)
            print(
                f"  {name}: {phase.sent} calls in {seconds:.0f}s {counts}; peak rise {phase.peak_rise_mib:.0f} MiB "
                f"(tree {phase.tree_rise_mib:.0f}), start {start_mib:.0f}, after {phase.after_mib:.0f} MiB. "
                f"{phase.extra}",
                flush=True,
            )
            for what, sentence in sorted(examples.items()):
                print(f"    {what}: {sentence}", flush=True)
        result.after = asyncio.run(normal_call(address, run_id, "after-flood"))
        print(f"  normal call after the flood: {result.after}", flush=True)
    finally:
        monitor.close()
        group.stop(f"peer-{tag}", timeout_s=30)
    return result


# ------------------------------------------------------------------------------------------------ report

CODES = ["OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"]
HEADERS = [
    "phase",
    "budget (--request-memory-bytes)",
    "calls",
    "OK",
    "INVALID_ARGUMENT",
    "RESOURCE_EXHAUSTED streams / memory / queue",
    "DEADLINE_EXCEEDED peer read / client",
    "other",
    "RSS at phase start MiB",
    "peak RSS rise MiB (peer process)",
    "tree peak rise MiB (sampled)",
    "RSS kept after MiB",
    "allowance MiB (budget + one call + windows + slack)",
    "within?",
]


def phase_row(run: BudgetRun, phase: Phase) -> list[object]:
    c = phase.counts
    other = {k: v for k, v in c.items() if not any(k.startswith(code) for code in CODES)}
    held = phase.peak_rise_mib <= run.allowance_mib()
    within = "yes" if held else f"**NO: {phase.peak_rise_mib - run.allowance_mib():.0f} MiB over**"
    return [
        phase.name,
        f"{run.budget_mib:.0f} MiB",
        phase.sent,
        c.get("OK", 0),
        c.get("INVALID_ARGUMENT", 0),
        " / ".join(
            str(c.get(f"RESOURCE_EXHAUSTED ({w})", 0)) for w in ("streams", "memory", "queue")
        ),
        f"{c.get('DEADLINE_EXCEEDED (peer read)', 0)} / {c.get('DEADLINE_EXCEEDED (client deadline)', 0)}",
        ", ".join(f"{k} {v}" for k, v in sorted(other.items())) or "0",
        f"{phase.start_mib:.0f}",
        f"{phase.peak_rise_mib:.0f}",
        f"{phase.tree_rise_mib:.0f}",
        f"{phase.after_mib:.0f}",
        "-" if phase.name == "one max call" else f"{run.allowance_mib():.0f}",
        "-" if phase.name == "one max call" else within,
    ]


def report(runs: list[BudgetRun], args) -> tuple[str, list[str]]:
    rows = []
    for index in range(len(runs[0].phases)):  # the budgets side by side, phase by phase
        rows += [phase_row(run, run.phases[index]) for run in runs]
    table = markdown_table(HEADERS, rows, right_align_from=2)
    rest = "; ".join(
        f"{r.budget_mib:.0f} MiB budget: peer process {r.rest_mib:.0f} MiB, tree {r.tree_rest_mib:.0f} MiB"
        for r in runs
    )
    after = "; ".join(f"{r.budget_mib:.0f} MiB budget: {r.after}" for r in runs)
    extras = [
        f"{r.budget_mib:.0f} MiB budget, {p.name}: {p.extra}"
        for r in runs
        for p in r.phases
        if p.extra
    ]
    broken = [
        (r, p)
        for r in runs
        for p in r.phases
        if p.name != "one max call" and p.peak_rise_mib > r.allowance_mib()
    ]
    notes = [
        f"Peer: `swarm peer --preset {PRESET} --stage {STAGE} --threads 1` (W1, stage {STAGE} of {NUM_STAGES}: "
        f"blocks 2-3, final LN, head and loss), default limits except `--request-memory-bytes` (the budget "
        f"column) and `--read-idle-s {args.read_idle_s:g}` (default 30, shortened to keep the run short); "
        f"`--max-streams-per-caller` 64, `--max-queued-calls` 32, `--max-microbatch-size` {MAX_BATCH}. "
        f"A largest request is a ({MAX_BATCH}, {SEQ_LEN}, {WIDTH}) float32 input (32 MiB) and its targets "
        f"(256 KiB), `eval_only` (the cheapest compute per byte received, so the most memory pressure).",
        f"RSS at rest (after two normal calls): {rest}.",
        f"Clients: {args.clients} processes x {args.streams} asyncio streams over 4 connections each (phase "
        f"`one max call`: 1 x 1, {ONE_CALL_REPEATS} calls in a row), all from 127.0.0.1, so one caller to the "
        f"peer. (b) keeps sending for {args.flood_s:g}s; every call that was started is then waited for.",
        "peak RSS rise = the peer process's VmHWM (reset with clear_refs at the start of the phase) minus its "
        "RSS at rest; tree = the peer, its hivemind DHT process and p2pd, sampled every 50 ms. RSS kept after = "
        "the peer's RSS once the phase's clients were done, over rest; the next phase starts from it, so its peak "
        "rise includes it.",
        "INTERNAL (`Internal error from Core`) is what a grpc.aio client reports when the peer ends a call while "
        "the client is still writing (grpc/grpc#36066): the peer answers a garbage stream at once, without "
        "draining it, and drains a refused request for at most 2 s; the peer's own status was INVALID_ARGUMENT "
        "or RESOURCE_EXHAUSTED. `RESOURCE_EXHAUSTED (message cap)`: gRPC's own 16 MiB message limit.",
        f"allowance = budget + the `one max call` rise (one admitted call: its request and the compute's working "
        f"set; the peer computes one call at a time) + the receive windows gRPC may hold for open calls "
        f"(--max-open-calls {LimitsConfig().max_open_calls} x --stream-window-bytes {args.window_bytes}) + "
        f"{SLACK_MIB} MiB for the allocator.",
        f"Normal call after the flood (compute_loss Forward of 8 sequences, with commit): {after}.",
        *extras,
    ]
    if broken:
        notes.append(
            "**A bound did not hold**: "
            + "; ".join(
                f"{p.name} at a {r.budget_mib:.0f} MiB budget peaked {p.peak_rise_mib:.0f} MiB over rest, "
                f"{p.peak_rise_mib - r.allowance_mib():.0f} MiB past the allowance"
                for r, p in broken
            )
            + "."
        )
    else:
        notes.append("Every phase stayed within its allowance.")
    return table, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--budgets",
        default=f"{1 << 30},{128 << 20}",
        help="comma-separated --request-memory-bytes values",
    )
    parser.add_argument("--clients", type=int, default=3, help="client processes per flood phase")
    parser.add_argument(
        "--streams", type=int, default=32, help="concurrent streams per client process"
    )
    parser.add_argument(
        "--flood-s", type=float, default=20.0, help="seconds phase (b) keeps sending"
    )
    parser.add_argument("--read-idle-s", type=float, default=5.0, help="the peer's --read-idle-s")
    parser.add_argument(
        "--window-bytes",
        type=int,
        default=LimitsConfig().stream_window_bytes,
        help="the peer's --stream-window-bytes",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "peer_flood.md")
    parser.add_argument(
        "--client", help=argparse.SUPPRESS
    )  # internal: run as a client with this JSON spec
    args = parser.parse_args()
    if args.client:
        counts = asyncio.run(client_main(json.loads(args.client)))
        print(RESULT + json.dumps(counts), flush=True)
        return

    from swarm.coordinator.launcher import ProcessGroup
    from swarm.coordinator.localswarm import start_bootstrap

    command = ".venv/bin/python bench/peer_flood.py" + "".join(f" {a}" for a in sys.argv[1:])
    info = RunInfo(command=command)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    with (
        tempfile.TemporaryDirectory(prefix="peer-flood-") as workdir,
        ProcessGroup(workdir) as group,
    ):
        addr_file = Path(workdir) / "bootstrap.addr"
        start_bootstrap(group, addr_file)
        runs = [run_budget(group, addr_file, budget, args) for budget in budgets]
    info.finish()
    info.extra += [
        "peer: 1 torch thread (--threads 1, OMP_NUM_THREADS=1); clients: grpc.aio, no torch",
        "one bootstrap DHT node, one peer at a time (stopped before the next budget), clients on loopback",
    ]
    table, notes = report(runs, args)
    body = "\n".join([table, "", *(f"- {n}" for n in notes)])
    path = write_result(
        args.out, title="A peer's peak RSS under a flood of hostile requests", info=info, body=body
    )
    print("\n" + table + "\n\n" + "\n".join(notes) + f"\n\nwritten to {path}")


if __name__ == "__main__":
    main()
