"""``swarm plot``: training curves from the trainer's metrics files (``swarm train --metrics-path``).

Each file holds one JSON object per line: a step's ``{"step", "loss", "tokens_per_s", "time_s"}`` and a
validation's ``{"step", "val_loss", "time_s"}``. The picture has two panels against the step: training and
validation loss, and tokens/s; several files are drawn over each other, labelled by file name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from swarm.errors import UsageError


@dataclass
class Curves:
    label: str
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)


def read_metrics(path: Path) -> Curves:
    """The curves in one metrics file. UsageError if it cannot be read or holds no step."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UsageError(f"cannot read the metrics file {path}: {e.strerror or e}") from None
    curves = Curves(label=path.stem)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
            if "loss" in record:
                loss, speed = float(record["loss"]), float(record["tokens_per_s"])
                curves.steps.append(step)
                curves.losses.append(loss)
                curves.tokens_per_s.append(speed)
            elif "val_loss" in record and math.isfinite(float(record["val_loss"])):
                curves.val_steps.append(step)
                curves.val_losses.append(float(record["val_loss"]))
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(
                f"{path}:{number} is not a line of `swarm train --metrics-path` ({type(e).__name__}: {e})"
            ) from None
    if not curves.steps:
        raise UsageError(
            f"{path} holds no training step: is it a file `swarm train --metrics-path` wrote?"
        )
    return curves


def plot(paths: list[Path], out: Path) -> Path:
    """Draw the curves of ``paths`` into ``out`` (PNG, or any format matplotlib knows by the suffix)."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError(
            "swarm plot needs matplotlib: pip install 'swarm[plot]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_metrics(path) for path in paths]
    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        (line,) = loss_ax.plot(run.steps, run.losses, label=f"{run.label} training", linewidth=1.2)
        if run.val_steps:
            loss_ax.plot(
                run.val_steps,
                run.val_losses,
                "o--",
                color=line.get_color(),
                label=f"{run.label} validation",
                markersize=4,
            )
        speed_ax.plot(
            run.steps, run.tokens_per_s, label=run.label, color=line.get_color(), linewidth=1.2
        )
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    speed_ax.set(xlabel="step", ylabel="tokens/s", title="throughput (since the start)")
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
