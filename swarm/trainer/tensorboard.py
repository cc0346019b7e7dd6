"""TensorBoard logging of a trainer's progress (``swarm train --tensorboard-dir DIR``; needs the ``tensorboard``
package: ``pip install 'swarm[tensorboard]'``).

One event directory per trainer start, ``DIR/RUN_ID/TRAINER_ID-START``, so several trainers of a run, or the
restarts of one, appear side by side in ``tensorboard --logdir DIR``. Scalars, by global step:

- ``train/loss``, ``train/tokens_per_s``: each step's mean training loss and the tokens/s since the start;
- ``val/loss``: each validation;
- ``pipeline/calls_retried``, ``pipeline/unconfirmed_commits``, ``pipeline/peers_banned_for_bad_replies``,
  ``pipeline/spot_checks_agreed``, ``pipeline/spot_checks_mismatched``: running totals of what the swarm's
  faults cost and what the spot-checks found.
"""

from __future__ import annotations

import time
from pathlib import Path

from swarm.errors import UsageError

# record key -> scalar tag
TAGS = {"loss": "train/loss", "tokens_per_s": "train/tokens_per_s", "val_loss": "val/loss"}


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError(
            "--tensorboard-dir needs the tensorboard package: pip install 'swarm[tensorboard]' (or "
            "tensorboard), or leave the flag out"
        ) from None
    return SummaryWriter


class TensorBoardLog:
    @staticmethod
    def require() -> None:
        """Raise UsageError now, before joining the swarm, if the tensorboard package is missing."""
        _summary_writer()

    def __init__(self, logdir: str | Path, *, run_id: str, trainer_id: str):
        SummaryWriter = _summary_writer()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = Path(logdir) / run_id / f"{trainer_id}-{stamp}"
        self._writer = SummaryWriter(log_dir=str(self.path))

    def record(self, record: dict, counters: dict[str, int]) -> None:
        """One metrics record of the trainer (a step's or a validation's, with its ``step``) and the pipeline's
        running totals at that moment."""
        step = int(record["step"])
        for key, tag in TAGS.items():
            if record.get(key) is not None:
                self._writer.add_scalar(tag, float(record[key]), step)
        for name, value in counters.items():
            self._writer.add_scalar(f"pipeline/{name}", value, step)
        self._writer.flush()  # a record a minute apart at most: readers see it at once

    def close(self) -> None:
        self._writer.close()
