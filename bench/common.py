"""Helpers shared by the benchmarks: the provenance every result file carries, tables, percentiles.

Every result file states when and where it was measured (date, commit, cores, load average before and
after: these 2-core machines are shared, so absolute numbers drift and only ratios measured in one run
compare), and the one command that reproduces it. Import it from a benchmark script run from the
repository root; importing also puts the checkout on ``sys.path``, so the scripts run without installing.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def git_revision() -> str:
    """``git rev-parse --short HEAD`` of the checkout, with "+dirty" when tracked files differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = (
            subprocess.run(
                ["git", "diff", "--quiet", "HEAD"], cwd=REPO_ROOT, capture_output=True, timeout=10
            ).returncode
            != 0
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def load_average() -> float:
    """1-minute load average (runnable processes); compare it with the core count to judge contention."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


@dataclass
class RunInfo:
    """Provenance of one benchmark run. Create it first (records the load before), ``finish()`` it last."""

    command: str  # the one command that reproduces the result, run from the repository root
    started: datetime.datetime = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc)
    )
    load_before: float = field(default_factory=load_average)
    load_after: float = float("nan")
    # more "- key: value" lines (threads, versions, ...)
    extra: list[str] = field(default_factory=list)

    def finish(self) -> None:
        self.load_after = load_average()

    def lines(self) -> list[str]:
        import torch

        cores = os.cpu_count()
        return [
            f"- date: {self.started.strftime('%Y-%m-%d %H:%M UTC')}",
            f"- git: {git_revision()}",
            f"- os.cpu_count(): {cores}; load average (1 min) before/after: {self.load_before:.2f}/"
            f"{self.load_after:.2f} (above {cores} means other processes competed for the cores)",
            f"- python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}",
            *(f"- {line}" for line in self.extra),
        ]


def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], *, right_align_from: int = 1
) -> str:
    """A GitHub markdown table; columns from ``right_align_from`` on are right-aligned (numbers)."""
    align = ["---" if i < right_align_from else "---:" for i in range(len(headers))]
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(out)


def write_result(path: Path, *, title: str, info: RunInfo, body: str) -> Path:
    """Write ``# title``, the reproduce command, the provenance lines and ``body`` to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(
        [
            f"# {title}",
            "",
            f"Reproduce: `{info.command}` (from the repository root)",
            "",
            *info.lines(),
            "",
            body.rstrip(),
            "",
        ]
    )
    path.write_text(text)
    return path


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class LossCurves:
    """One training run's curves for :func:`plot_loss_curves`."""

    label: str
    train: list[tuple[float, float]]  # (samples trained, training loss of that step)
    val: list[tuple[float, float]]  # (samples trained, validation loss)


def plot_loss_curves(
    runs: Sequence[LossCurves], *, title: str, path: Path, window: int = 5
) -> None:
    """Training loss (moving average over ``window`` steps: one step's loss is a noisy estimate) and validation
    loss of several runs, side by side, against samples trained; saved as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        losses = [loss for _, loss in run.train]
        smooth = [
            sum(losses[max(0, i - window + 1) : i + 1])
            / len(losses[max(0, i - window + 1) : i + 1])
            for i in range(len(losses))
        ]
        ax_train.plot([samples for samples, _ in run.train], smooth, label=run.label)
        ax_val.plot(*zip(*run.val), marker="o", label=f"{run.label} ({run.val[-1][1]:.3f})")
    ax_train.set(
        title=f"training loss ({window}-step moving average)",
        xlabel="samples",
        ylabel="loss (nats/byte)",
    )
    ax_val.set(title="validation loss", xlabel="samples", ylabel="loss (nats/byte)")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
