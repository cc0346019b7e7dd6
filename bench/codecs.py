"""Throughput and accuracy of swarm's wire codecs next to hivemind 1.1.12's compression codecs.

Run from the repository root:  .venv/bin/python bench/codecs.py
Prints a markdown table and writes it, with the environment, to bench/results/codecs.md.

Throughput is MB/s (10^6 bytes) of float32 input per second of encode + decode, best of ``--repeats``
runs, on ``--threads`` torch threads (1 by default). Relative error is ||x - dec(enc(x))|| / ||x||. A codec
that fails is reported with the exception it raised, never hidden.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as a script from a checkout without installing

from swarm.compression import CODEC_NAMES, get_codec  # noqa: E402

SIZES_MIB = (1, 16)
DISTRIBUTIONS = ("normal", "student_t2")


@dataclasses.dataclass(kw_only=True)
class Row:
    """One codec on one tensor."""

    codec: str  # "swarm int8", "hivemind Float16Compression", ...
    tensor: str  # e.g. "16 MiB student_t2"
    wire_bytes_per_value: float | None  # payload bytes / element count
    encode_mb_s: float | None  # MB/s of float32 input
    decode_mb_s: float | None
    round_trip_mb_s: float | None  # encode + decode
    relative_error: float | None
    note: str = ""


def make_tensor(distribution: str, numel: int, seed: int = 0) -> torch.Tensor:
    """(numel,) float32 samples: standard normal, or Student-t with 2 degrees of freedom (heavy tails)."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(numel, generator=generator)
    if distribution == "normal":
        return normal
    # t(2) = Z / sqrt(chi2(2) / 2) with chi2(2) = -2 log U
    uniform = torch.rand(numel, generator=generator).clamp_min_(1e-12)
    return normal / torch.sqrt(-torch.log(uniform))


def best_time_s(function: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Smallest wall time of ``repeats`` calls and the last result (the first call also warms caches)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def relative_error(original: torch.Tensor, decoded: torch.Tensor) -> float:
    return float(
        (original.double() - decoded.double().reshape(-1)).norm() / original.double().norm()
    )


def measure(
    codec: str,
    tensor_name: str,
    flat: torch.Tensor,
    encode: Callable,
    decode: Callable,
    size: Callable,
    repeats: int,
) -> Row:
    """Time ``encode(flat) -> payload`` and ``decode(payload) -> tensor``; report where it fails instead of raising."""
    input_mb = flat.numel() * 4 / 1e6
    try:
        encode_s, payload = best_time_s(lambda: encode(flat), repeats)
    except Exception as error:  # noqa: BLE001 - the benchmark reports every failure as a table cell
        return Row(
            codec=codec,
            tensor=tensor_name,
            wire_bytes_per_value=None,
            encode_mb_s=None,
            decode_mb_s=None,
            round_trip_mb_s=None,
            relative_error=None,
            note=f"encode fails: {describe(error)}",
        )
    bytes_per_value = size(payload) / flat.numel()
    try:
        decode_s, decoded = best_time_s(lambda: decode(payload), repeats)
    except Exception as error:  # noqa: BLE001
        return Row(
            codec=codec,
            tensor=tensor_name,
            wire_bytes_per_value=bytes_per_value,
            encode_mb_s=input_mb / encode_s,
            decode_mb_s=None,
            round_trip_mb_s=None,
            relative_error=None,
            note=f"decode fails: {describe(error)}",
        )
    return Row(
        codec=codec,
        tensor=tensor_name,
        wire_bytes_per_value=bytes_per_value,
        encode_mb_s=input_mb / encode_s,
        decode_mb_s=input_mb / decode_s,
        round_trip_mb_s=input_mb / (encode_s + decode_s),
        relative_error=relative_error(flat, decoded),
    )


def describe(error: Exception) -> str:
    """``Type: first sentence`` of an exception, short enough for a table cell."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line[:120]}"


def swarm_rows(tensor_name: str, flat: torch.Tensor, repeats: int) -> list[Row]:
    rows = []
    for name in CODEC_NAMES:
        codec = get_codec(name)
        rows.append(
            measure(
                f"swarm {name}",
                tensor_name,
                flat,
                codec.encode,
                lambda payload, codec=codec: codec.decode(payload, flat.numel(), flat.dtype),
                len,
                repeats,
            )
        )
    return rows


def hivemind_rows(tensor_name: str, flat: torch.Tensor, repeats: int) -> list[Row]:
    import hivemind.compression as hc

    info = hc.CompressionInfo.from_tensor(flat)
    rows = []
    for class_name in (
        "NoCompression",
        "Float16Compression",
        "ScaledFloat16Compression",
        "Uniform8BitQuantization",
        "Quantile8BitQuantization",
        "BlockwiseQuantization",
    ):
        codec = getattr(hc, class_name)()
        rows.append(
            measure(
                f"hivemind {class_name}",
                tensor_name,
                flat,
                lambda x, c=codec: c.compress(x, info),
                codec.extract,
                lambda message: len(message.buffer),
                repeats,
            )
        )
        if (
            class_name in ("Uniform8BitQuantization", "Quantile8BitQuantization")
            and rows[-1].relative_error is None
        ):
            # hivemind's own extract() fails under numpy 2; read its documented layout ourselves so the accuracy of
            # the 8-bit format can still be compared (int64 codebook size, float32 codebook, uint8 indices)
            rows.append(
                measure(
                    f"hivemind {class_name} (bench's own reader)",
                    tensor_name,
                    flat,
                    lambda x, c=codec: c.compress(x, info),
                    _read_codebook_message,
                    lambda message: len(message.buffer),
                    repeats,
                )
            )
    return rows


def _read_codebook_message(message) -> torch.Tensor:
    buffer = message.buffer
    codebook_size = int(np.frombuffer(buffer, count=1, dtype="<i8")[0])
    codebook = torch.from_numpy(
        np.frombuffer(buffer, offset=8, count=codebook_size, dtype="<f4").copy()
    )
    indices = torch.from_numpy(
        np.frombuffer(buffer, offset=8 + 4 * codebook_size, dtype=np.uint8).copy()
    )
    return codebook[indices.long()]


def warm_up(duration_s: float = 1.0) -> None:
    """Run the swarm codecs for a while before timing anything: the first calls of a process pay for thread-pool
    start-up and page faults, which otherwise land on whichever codec is measured first."""
    flat = make_tensor("normal", 1 << 18)
    deadline = time.perf_counter() + duration_s
    while time.perf_counter() < deadline:
        for name in CODEC_NAMES:
            codec = get_codec(name)
            codec.decode(codec.encode(flat), flat.numel(), flat.dtype)


def format_number(value: float | None, pattern: str) -> str:
    return "—" if value is None else format(value, pattern)


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| tensor | codec | bytes/value | encode MB/s | decode MB/s | enc+dec MB/s | relative error | note |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        note = row.note.replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {row.tensor} | {row.codec} | {format_number(row.wire_bytes_per_value, '.4f')} | "
            f"{format_number(row.encode_mb_s, '.0f')} | {format_number(row.decode_mb_s, '.0f')} | "
            f"{format_number(row.round_trip_mb_s, '.0f')} | {format_number(row.relative_error, '.2e')} | {note} |"
        )
    return "\n".join(lines)


def versus_int8(rows: list[Row]) -> str:
    """The swarm codecs below 8 bits against swarm int8 on the same tensor, in the same run: speed ratios of
    encode and decode (MB/s of float32 input, > 1 = faster than int8), bytes on the wire, and error."""
    lines = [
        "| tensor | codec | bytes/value vs int8 | encode speed vs int8 | decode speed vs int8 | "
        "relative error vs int8 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    int8 = {row.tensor: row for row in rows if row.codec == "swarm int8"}
    for row in rows:
        reference = int8.get(row.tensor)
        if not row.codec.startswith("swarm int") or row.codec == "swarm int8" or reference is None:
            continue
        if row.encode_mb_s is None or row.decode_mb_s is None or reference.decode_mb_s is None:
            continue
        lines.append(
            f"| {row.tensor} | {row.codec} | {row.wire_bytes_per_value / reference.wire_bytes_per_value:.2f}x | "
            f"{row.encode_mb_s / reference.encode_mb_s:.2f}x | {row.decode_mb_s / reference.decode_mb_s:.2f}x | "
            f"{row.relative_error / reference.relative_error:.1f}x |"
        )
    return "\n".join(lines)


def int8_versus_hivemind(rows: list[Row]) -> str:
    """swarm int8's encode + decode speed over hivemind's 8-bit codecs' (those that decode, with the bench's own
    reader where hivemind's fails), and their relative errors, per tensor (the issue's bound: >= 3x)."""
    lines = []
    for tensor in dict.fromkeys(r.tensor for r in rows):
        ours = next((r for r in rows if r.tensor == tensor and r.codec == "swarm int8"), None)
        if ours is None or ours.round_trip_mb_s is None:
            continue
        for theirs in rows:
            if (
                theirs.tensor == tensor
                and "8Bit" in theirs.codec
                and theirs.round_trip_mb_s is not None
            ):
                lines.append(
                    f"- {tensor}: swarm int8 enc+dec {ours.round_trip_mb_s / theirs.round_trip_mb_s:.2f}x "
                    f"{theirs.codec} (relative error {ours.relative_error:.2e} vs {theirs.relative_error:.2e})"
                )
    return "\n".join(lines)


def failures_section(rows: list[Row]) -> str:
    """One line per codec that failed on some tensor, with what it raised, so failures are read, not skimmed."""
    failures = dict.fromkeys(f"- {row.codec}: {row.note}" for row in rows if row.note)
    if not failures:
        return "All codecs encoded and decoded every tensor.\n"
    return "\n".join([f"Failures on numpy {np.__version__}:", "", *failures, ""])


def git_revision() -> str:
    try:
        completed = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({type(error).__name__})"
    if completed.returncode != 0:
        return "none (no commit yet)"
    return completed.stdout.strip()


def environment(load_before: float) -> str:
    import hivemind

    return "\n".join(
        [
            f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            f"- git: {git_revision()}",
            f"- os.cpu_count(): {os.cpu_count()}, torch threads: {torch.get_num_threads()}, load average (1 min) "
            f"before/after: {load_before:.2f}/{os.getloadavg()[0]:.2f} (other processes share these cores)",
            f"- python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
            f"hivemind {hivemind.__version__}, {platform.machine()}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed runs per measurement; the best one counts"
    )
    # one thread by default: on a small shared machine, OpenMP threads spin-waiting on a busy core make timings
    # swing 10x; peers doing codec work next to a training step get about one core anyway
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default: 1)"
    )
    parser.add_argument(
        "--output", type=Path, default=REPO_ROOT / "bench" / "results" / "codecs.md"
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    # torch.jit/quantize deprecation noise from hivemind's import and codecs
    warnings.filterwarnings("ignore")

    warm_up()
    rows: list[Row] = []
    for size_mib in SIZES_MIB:
        for distribution in DISTRIBUTIONS:
            tensor_name = f"{size_mib} MiB {distribution}"
            flat = make_tensor(distribution, size_mib * (1 << 20) // 4)
            rows += swarm_rows(tensor_name, flat, args.repeats)
            rows += hivemind_rows(tensor_name, flat, args.repeats)
            print(f"measured {tensor_name}", file=sys.stderr)
    table = markdown_table(rows)
    print(table)

    report = "\n\n".join(
        [
            "# Codec benchmark: swarm.compression vs hivemind.compression",
            "Reproduce: `.venv/bin/python bench/codecs.py` (from the repository root; under a minute on 2 cores).",
            environment(load_before),
            "Tensors are float32: `normal` is N(0, 1); `student_t2` is Student-t with 2 degrees of freedom (heavy "
            "tails, infinite variance). MB/s counts 10^6 bytes of float32 input per second, best of "
            f"{args.repeats} runs. bytes/value is the payload size per element (float32 = 4). relative error is "
            "||x - dec(enc(x))|| / ||x||. swarm int8 = blockwise absmax, 32-element blocks, one bfloat16 scale each; "
            "int4 and int2 = 4 and 2 bits per value, 32-element blocks, one bfloat16 scale each whose sign bit picks "
            "the block's grid; int4sr and int2sr the same with stochastic rounding (swarm/compression/lowbit.py).",
            table,
            "swarm int8 against hivemind's 8-bit codecs, same run:",
            int8_versus_hivemind(rows),
            "Codecs below 8 bits against int8, measured side by side in this run:",
            versus_int8(rows),
            failures_section(rows),
        ]
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
