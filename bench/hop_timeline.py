"""Where one hop's time goes: timestamps at each step of a ``bench/hop_overhead.py`` call, medians per step.

Run from the repository root:
    .venv/bin/python bench/hop_timeline.py [--codec none] [--calls 150] [--size 1] [--plaintext]

Prints a table of median milliseconds per step (nothing is written under bench/results; paste what you need).

It runs ``hop_overhead.py``'s case of ``--size`` MiB for one codec (the same peer, client and process layout) with the
swarm code wrapped at each step: the client's call start, its first frame encoded, the peer's request and input read,
the hop to the compute thread and back, the reply encoded, the client's reply read and decoded, and the call's
return; the raw echo of the same bytes is timed as one round trip. The wrappers cost a few microseconds
a step; steps are wall time on a shared machine, so they include waits for the GIL and for the cores.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hop_overhead as hop  # noqa: E402

import swarm.peer.service as service  # noqa: E402
import swarm.transport.client as client  # noqa: E402
import swarm.transport.tensors as tensors  # noqa: E402

EVENTS: list[tuple[str, float]] = []


def mark(step: str) -> None:
    EVENTS.append((step, time.perf_counter()))


class PeerReader(tensors.FrameReader):
    async def request(self):
        meta = await super().request()
        mark("S1 peer: request meta read")
        return meta

    async def tensors(self, *args, **kwargs):
        out = await super().tensors(*args, **kwargs)
        mark("S2 peer: input read, checked, decoded")
        return out


class ClientReader(tensors.FrameReader):
    async def reply(self):
        meta = await super().reply()
        mark("C5 client: reply meta read")
        return meta

    async def tensors(self, *args, **kwargs):
        out = await super().tensors(*args, **kwargs)
        mark("C6 client: output read, checked, decoded")
        return out


def instrument() -> None:
    """Wrap the swarm steps of a hop (client, peer service, compute thread) with :func:`mark`."""
    service.FrameReader = PeerReader
    client.FrameReader = ClientReader

    compute = service.StageService._compute

    async def timed_compute(self, fn, *args, work, **kwargs):
        mark("S3 peer: admitted, to the compute thread")

        def on_thread(*a, **k):
            mark("W1 compute thread starts")
            try:
                return fn(*a, **k)
            finally:
                mark("W2 compute thread ends")

        result = await compute(self, on_thread, *args, work=work, **kwargs)
        mark("S4 peer: event loop resumes")
        return result

    service.StageService._compute = timed_compute

    def first_frame(frames, step):
        async def wrapped(*args, **kwargs):
            first = True
            async for frame in frames(*args, **kwargs):
                if first:
                    mark(step)
                    first = False
                yield frame

        return wrapped

    service.tensor_frames = first_frame(service.tensor_frames, "S5 peer: reply frame encoded")
    client.tensor_frames = first_frame(client.tensor_frames, "C1 client: request frame encoded")

    forward = client.PeerClient.forward

    async def timed_forward(self, *args, **kwargs):
        mark("C0 client: call starts")
        reply = await forward(self, *args, **kwargs)
        mark("C7 client: call returns")
        return reply

    client.PeerClient.forward = timed_forward

    echo_call = hop.echo_call

    async def timed_echo(echo, x):
        mark("R0 raw: call starts")
        await echo_call(echo, x)
        mark("R1 raw: call returns")

    hop.echo_call = timed_echo


def steps_of(
    events: list[tuple[str, float]], start: str, skip: int
) -> list[list[tuple[str, float]]]:
    """The events of each call that begins with ``start`` (a raw echo's, or a swarm hop's: client, peer and
    compute thread), after the first ``skip`` calls (warmup)."""
    raw = start.startswith("R")
    calls: list[list[tuple[str, float]]] = []
    for step, at in events:
        if step.startswith("R") != raw:
            continue
        if step.startswith(start):
            calls.append([])
        if calls:
            calls[-1].append((step, at))
    return calls[skip:]


def table(calls: list[list[tuple[str, float]]]) -> list[str]:
    gaps: dict[str, list[float]] = collections.defaultdict(list)
    for call in calls:
        for (_, before), (step, after) in zip(call, call[1:]):
            gaps[step].append(1e3 * (after - before))
    lines = [f"| {step} | {statistics.median(ms):.2f} |" for step, ms in gaps.items()]
    total = statistics.median(1e3 * (c[-1][1] - c[0][1]) for c in calls)
    return [*lines, f"| total | {total:.2f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--codec", default="none")
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument(
        "--size", default="1", choices=["0.125", "1"], help="MiB each way (0.125: codec none only)"
    )
    parser.add_argument("--plaintext", action="store_true", help="the peer serves without TLS")
    args = parser.parse_args()
    raw = hop.RAW if args.plaintext else hop.RAW_TLS
    instrument()
    sys.argv = [
        "hop_overhead.py",
        *("--codecs", f"{args.codec},{raw}", "--sizes", args.size, "--big-mib", "0"),
        *("--repeats", str(args.calls), "--warmup", "3", "--out", "/dev/null"),
        *(["--plaintext"] if args.plaintext else []),
    ]
    hop.main()
    peer = "plaintext" if args.plaintext else "TLS"
    print(
        f"\n{args.size} MiB {args.codec} hop, peer serving {peer}; median ms since the step before\n"
    )
    print("| step (ends at) | median ms |\n| --- | ---: |")
    print("\n".join(table(steps_of(EVENTS, "C0", 3))))
    print(f"\n{raw} echo of the same bytes\n")
    print("| step (ends at) | median ms |\n| --- | ---: |")
    print("\n".join(table(steps_of(EVENTS, "R0", 3))))


if __name__ == "__main__":
    main()
