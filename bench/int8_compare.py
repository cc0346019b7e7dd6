"""The int8 codec against another version of itself, fp16 and hivemind's 8-bit codec, call by call in one process.

Run from the repository root:
    .venv/bin/python bench/int8_compare.py --old ../other-checkout/swarm/compression/int8.py --rounds 200

On a shared machine, sequential runs of bench/codecs.py drift with the load; timing every codec in turn within one
round gives ratios that share it. Before timing, the old codec's payloads are checked byte for byte against this
checkout's (and its decoded values too) on float16/32/64 and bfloat16 inputs, tails and magnitudes from 1e-44 to
1e37: a speed-up must not change the wire format. hivemind's ``Uniform8BitQuantization`` is decoded with
bench/codecs.py's own reader (its ``extract`` fails under numpy 2). Prints minima and medians in microseconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from swarm.compression import get_codec  # noqa: E402

NUMEL = 1 << 18  # 1 MiB of float32


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def check_identical(old, new) -> None:
    generator = torch.Generator().manual_seed(0)
    for numel in (1, 31, 32, 33, 1000, 4096 + 7, NUMEL):
        for magnitude in (1e-44, 1e-38, 1e-30, 1e-3, 1.0, 1e20, 1e37):
            for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
                x = torch.randn(numel, generator=generator, dtype=torch.float64) * magnitude
                x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
                x[::7] = 0
                results = []
                for codec in (old, new):
                    try:
                        results.append(codec.encode(x))
                    except Exception as error:  # noqa: BLE001 - both must fail alike
                        results.append(type(error))
                if results[0] != results[1]:
                    raise SystemExit(f"payloads differ: {numel} values of {dtype} at {magnitude:g}")
                if isinstance(results[0], bytes) and not torch.equal(
                    old.decode(results[0], numel, dtype), new.decode(results[0], numel, dtype)
                ):
                    raise SystemExit(
                        f"decoded values differ: {numel} values of {dtype} at {magnitude:g}"
                    )
    print("old and new int8: byte-identical payloads, identical decoded values")


def sample(distribution: str, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=generator)
    if distribution == "student_t2":
        x = x / torch.sqrt(-torch.log(torch.rand(NUMEL, generator=generator).clamp_min_(1e-12)))
    return x


def compare(distribution: str, x: torch.Tensor, codecs: dict, reader, rounds: int) -> None:
    """Time every codec in turn, ``rounds`` times, on ``x``; print minima, medians and ratios."""
    new, fp16, uniform, old = codecs["int8"], codecs["fp16"], codecs["hivemind"], codecs["old"]
    import hivemind.compression as hc

    payload, half = new.encode(x), fp16.encode(x)
    info = hc.CompressionInfo.from_tensor(x)
    message = uniform.compress(x, info)
    timed = {
        "hivemind u8 encode": lambda: uniform.compress(x, info),
        "hivemind u8 decode": lambda: reader(message),
        "int8 encode": lambda: new.encode_view(x),
        "int8 decode": lambda: new.decode(payload, NUMEL, torch.float32),
        "fp16 encode": lambda: fp16.encode_view(x),
        "fp16 decode": lambda: fp16.decode(half, NUMEL, torch.float32),
    }
    if old is not None:
        timed["old int8 encode"] = lambda: old.encode_view(x)
        timed["old int8 decode"] = lambda: old.decode(payload, NUMEL, torch.float32)
    seconds = {name: [] for name in timed}
    for _ in range(rounds):
        for name, function in timed.items():
            start = time.perf_counter()
            function()
            seconds[name].append(time.perf_counter() - start)
    print(f"1 MiB {distribution}, {rounds} rounds, one thread (µs)")
    for name, values in seconds.items():
        values.sort()
        print(f"  {name:20s} min {values[0] * 1e6:7.1f}  p50 {values[len(values) // 2] * 1e6:7.1f}")
    for label, pick in (("min", lambda v: v[0]), ("p50", lambda v: v[len(v) // 2])):
        t = {name: pick(values) for name, values in seconds.items()}
        new_s = t["int8 encode"] + t["int8 decode"]
        hm_s = t["hivemind u8 encode"] + t["hivemind u8 decode"]
        half_s = t["fp16 encode"] + t["fp16 decode"]
        line = (
            f"  {label}: int8 enc+dec {new_s * 1e6:.0f} µs = {hm_s / new_s:.2f}x hivemind's speed, "
        )
        line += f"{new_s / half_s:.2f}x fp16's time"
        if old is not None:
            old_s = t["old int8 encode"] + t["old int8 decode"]
            line += f"; old {old_s * 1e6:.0f} µs = {hm_s / old_s:.2f}x hivemind's, {old_s / half_s:.2f}x fp16's"
        print(line)
    decoded = new.decode(payload, NUMEL, torch.float32)
    print(
        f"  relative error: int8 {float((x - decoded).norm() / x.norm()):.2e}, hivemind u8 "
        f"{float((x - reader(message)).norm() / x.norm()):.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=Path, help="another checkout's swarm/compression/int8.py")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import hivemind.compression as hc

    reader = load_module("bench_codecs", REPO_ROOT / "bench" / "codecs.py")._read_codebook_message
    new, fp16, uniform = get_codec("int8"), get_codec("fp16"), hc.Uniform8BitQuantization()
    old = load_module("old_int8", args.old).BlockwiseInt8Codec() if args.old else None
    if old is not None:
        check_identical(old, new)
    generator = torch.Generator().manual_seed(1)
    codecs = {"int8": new, "fp16": fp16, "hivemind": uniform, "old": old}
    for distribution in ("normal", "student_t2"):
        compare(distribution, sample(distribution, generator), codecs, reader, args.rounds)


if __name__ == "__main__":
    main()
