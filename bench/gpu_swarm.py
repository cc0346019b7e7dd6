"""A swarm on this machine's GPUs against the same model trained in one process on one of them.

Run from the repository root:  .venv/bin/python bench/gpu_swarm.py [--seconds 60] [--dtype bf16]
    [--configs w2:2,gpt2-small:2,gpt2-small:4]
Prints a markdown table and writes it, with the environment, to bench/results/gpu_swarm.md. On a machine where
torch sees no CUDA device it prints "no GPU" and exits 0.

Swarm side: a bootstrap DHT node, one ``swarm peer --device cuda:N --dtype D`` per stage (stages dealt round-robin
over the GPUs, so several peers share one when there are more stages than GPUs) and one trainer, all separate
processes (``LocalSwarm``). Tokens/s is taken from the trainer's metrics over the window after ``--warmup-seconds``
of training, as bench/swarm_throughput.py does. GPU utilisation (mean over the window) and memory in use (peak)
are sampled from ``nvidia-smi`` every 0.5 s (blank without it).

One process: the whole model (``build_full_model``) on cuda:0 in the same dtype under autocast, AdamW over all
parameters, the swarm's microbatch and global batch, timed over the batches after a warmup; its memory is
``torch.cuda.max_memory_allocated``.

Workloads: W2 (BENCHMARKS.md: d_model 512, 4 blocks, seq_len 256, 2 stages) and GPT-2 small (124M parameters,
seq_len 1024, ``gpt2-small`` preset) in 2 and 4 stages; microbatch 8, lr 3e-4, global batch 32.
"""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import RESULTS_DIR, RunInfo, markdown_table, write_result  # noqa: E402
from swarm_throughput import (  # noqa: E402
    IN_FLIGHT,
    MICROBATCH,
    start_timed_trainer,
    window_tokens_per_s,
)

from swarm.compression import CODEC_NAMES  # noqa: E402
from swarm.coordinator.localswarm import LocalSwarm, wait_ready  # noqa: E402
from swarm.data import ByteCorpus, DataConfig  # noqa: E402
from swarm.model import ALL_PRESETS, build_full_model  # noqa: E402
from swarm.model.device import Compute  # noqa: E402

TARGET_BATCH = 32  # samples per optimizer step
LR = 3e-4  # BENCHMARKS.md
DEFAULT_CONFIGS = "w2:2,gpt2-small:2,gpt2-small:4"


class GpuSampler:
    """``nvidia-smi`` every ``period_s`` in a thread: mean utilisation (%) and peak memory used (MiB, all GPUs
    summed) between :meth:`start` and :meth:`stop`; None where nvidia-smi is missing or fails."""

    def __init__(self, period_s: float = 0.5):
        self.period_s = period_s
        self.util: list[float] = []
        self.mem_mib: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._smi = shutil.which("nvidia-smi")

    def _sample(self) -> None:
        query = "--query-gpu=utilization.gpu,memory.used"
        done = subprocess.run(
            [self._smi, query, "--format=csv,noheader,nounits"], capture_output=True, text=True
        )
        if done.returncode != 0:
            return
        rows = [line.split(",") for line in done.stdout.strip().splitlines()]
        self.util.append(sum(float(u) for u, _ in rows) / len(rows))
        self.mem_mib.append(sum(float(m) for _, m in rows))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def start(self) -> GpuSampler:
        if self._smi:
            self._thread.start()
        return self

    def stop(self) -> tuple[float | None, float | None]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if not self.util:
            return None, None
        return sum(self.util) / len(self.util), max(self.mem_mib)


def measure_swarm(
    preset: str,
    num_stages: int,
    *,
    dtype: str,
    seconds: float,
    warmup_s: float,
    workdir: Path,
    codec: str = "none",
    activations: str = "relayed",
) -> dict:
    gpus = torch.cuda.device_count()
    run_id = f"gpu-{preset}-{num_stages}"
    with LocalSwarm(workdir) as swarm:
        run_flags = [
            "--preset",
            preset,
            "--num-stages",
            num_stages,
            "--target-batch-size",
            TARGET_BATCH,
            "--codec",
            codec,
        ]
        peer_flags = ["--lr", LR, "--no-average", "--no-rebalance", "--dtype", dtype]
        procs = [
            swarm.peer(
                f"peer-s{stage}",
                stage,
                *run_flags,
                *peer_flags,
                "--device",
                f"cuda:{stage % gpus}",
                run_id=run_id,
                wait=False,
            )
            for stage in range(num_stages)
        ]
        for proc in procs:
            wait_ready(proc)
        metrics = workdir / f"metrics-{run_id}.jsonl"
        trainer = start_timed_trainer(
            swarm, "trainer", run_id, metrics, timeout_s=300, activations=activations
        )
        time.sleep(warmup_s)  # a benchmark's fixed measuring period, not a wait for an event
        sampler = GpuSampler().start()
        time.sleep(seconds)
        util, mem_mib = sampler.stop()
        code = swarm.group.stop("trainer", sig=signal.SIGINT, timeout_s=30)
        if code not in (0, 130):
            raise RuntimeError(f"the trainer exited with code {code}; see {trainer.log_path}")
        tokens_per_s, window_s, steps = window_tokens_per_s(metrics, warmup_s)
    return dict(tokens_per_s=tokens_per_s, util=util, mem_mib=mem_mib, steps=steps)


def measure_one_process(
    preset: str,
    corpus: ByteCorpus,
    *,
    dtype: str,
    seconds: float,
    warmup_steps: int = 2,
    device: str = "cuda:0",
) -> dict:
    """The whole model on cuda:0: ``warmup_steps`` global batches, then global batches for about ``seconds``."""
    config = ALL_PRESETS[preset]  # its stages one after another in this process: the same compute
    compute = Compute.from_flags(device, dtype)
    if compute.is_cuda:
        torch.cuda.reset_peak_memory_stats(compute.device)
    model = build_full_model(config, device=compute.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(0)
    per_step = math.ceil(TARGET_BATCH / MICROBATCH)
    sampler, marks, step = None, [], 0
    while True:
        for _ in range(per_step):
            batch = compute.to_device(corpus.sample("train", MICROBATCH, config.seq_len, generator))
            with compute.autocast():
                loss = model.loss(batch[:, :-1], batch[:, 1:])
            (loss / per_step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        compute.synchronize()
        step += 1
        marks.append(time.perf_counter())
        if step == warmup_steps:
            sampler = GpuSampler().start()
        if step > warmup_steps and marks[-1] - marks[warmup_steps - 1] >= seconds:
            break
    util, _ = sampler.stop() if sampler is not None else (None, None)
    timed = step - warmup_steps
    tokens = timed * per_step * MICROBATCH * config.seq_len
    return dict(
        tokens_per_s=tokens / (marks[-1] - marks[warmup_steps - 1]),
        util=util,
        mem_mib=torch.cuda.max_memory_allocated(compute.device) / 2**20
        if compute.is_cuda
        else None,
        steps=timed,
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per row")
    parser.add_argument(
        "--warmup-seconds", type=float, default=20.0, help="swarm training before measuring"
    )
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=f"preset:stages, comma-separated ({DEFAULT_CONFIGS})",
    )
    parser.add_argument(
        "--codec", default="none", choices=CODEC_NAMES, help="the run's wire codec (default none)"
    )
    parser.add_argument(
        "--activations",
        default="relayed",
        choices=["relayed", "push"],
        help="the trainer's --activations (default relayed)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: torch sees no CUDA device here; nothing measured")
        return 0
    configs = [
        (name, int(stages)) for name, stages in (c.split(":") for c in args.configs.split(","))
    ]
    info = RunInfo(
        command=f"python bench/gpu_swarm.py --seconds {args.seconds:g} --dtype {args.dtype} "
        f"--codec {args.codec} --activations {args.activations}"
    )
    names = ", ".join(torch.cuda.get_device_name(k) for k in range(torch.cuda.device_count()))
    info.extra.append(
        f"GPUs: {names}; compute dtype {args.dtype}; microbatch {MICROBATCH}, in flight {IN_FLIGHT}"
    )
    corpus = ByteCorpus.load(DataConfig())
    rows, local_cache = [], {}
    for preset, stages in configs:
        if preset not in local_cache:
            local_cache[preset] = measure_one_process(
                preset, corpus, dtype=args.dtype, seconds=args.seconds
            )
            one = local_cache[preset]
            rows.append(
                [preset, "one process", f"{one['tokens_per_s']:,.0f}", "1.00",
                 _fmt(one["util"], ".0f"), _fmt(one["mem_mib"], ",.0f")]
            )  # fmt: skip
            print(f"  {preset} one process: {one['tokens_per_s']:,.0f} tokens/s", flush=True)
            torch.cuda.empty_cache()
        with tempfile.TemporaryDirectory(prefix="gpu-swarm-") as tmp:
            got = measure_swarm(
                preset, stages, dtype=args.dtype, seconds=args.seconds,
                warmup_s=args.warmup_seconds, workdir=Path(tmp), codec=args.codec,
                activations=args.activations,
            )  # fmt: skip
        ratio = got["tokens_per_s"] / local_cache[preset]["tokens_per_s"]
        rows.append(
            [preset, f"swarm, {stages} stages x 1 peer", f"{got['tokens_per_s']:,.0f}", f"{ratio:.2f}",
             _fmt(got["util"], ".0f"), _fmt(got["mem_mib"], ",.0f")]
        )  # fmt: skip
        print(
            f"  {preset} {stages} stages: {got['tokens_per_s']:,.0f} tokens/s ({ratio:.2f}x)",
            flush=True,
        )
    info.finish()
    table = markdown_table(
        ["model", "system", "tokens/s", "÷ one process", "GPU util %", "GPU memory MiB"], rows,
        right_align_from=2,
    )  # fmt: skip
    print(table)
    body = (
        table
        + "\n\nGPU memory: the swarm's is nvidia-smi's peak of all processes on the GPUs (CUDA contexts "
        "included); one process's is torch.cuda.max_memory_allocated. Utilisation: mean of nvidia-smi samples.\n"
    )
    path = write_result(
        RESULTS_DIR / "gpu_swarm.md", title="GPU swarm against one process", info=info, body=body
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
