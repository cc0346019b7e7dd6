"""The trainer's bound on the gradients peers send back: a reply whose input gradient per sample is an outlier
against the stage's recent ones (swarm.outliers) is refused before it is committed (a ``BadReply``: the peer is
banned for the run, the call goes to another peer of the stage, and the refused gradient is never counted).

A gradient passes from stage to stage through the trainer, so one lying peer could swamp every stage below it with
a huge gradient, finite and well shaped (the reply checks pass it). Peers bound what they are made to compute too
(``--max-gradient-ratio``, swarm.peer.executor); this is the same rule one hop earlier, where the trainer still
knows which peer to blame. The first ``swarm.outliers.MIN`` gradients of each stage are not judged (there is no
reference yet).
"""

from __future__ import annotations

import torch

from swarm.errors import InvalidRequest
from swarm.outliers import OutlierBound


class GradientWatch:
    def __init__(self, num_stages: int, *, max_ratio: float):
        self._bounds = [OutlierBound(max_ratio) for _ in range(num_stages)]

    def judge(self, stage: int, samples: int):
        """The reply judge (see swarm.transport.client.Judge) of a gradient call to ``stage``; None without a
        bound (nothing to measure)."""
        if not self._bounds[stage].active:
            return None

        def check(meta, tensors: dict[str, torch.Tensor]) -> None:
            grad = tensors.get("grad_input")
            if grad is None:
                return
            norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64))
            if why := self._bounds[stage].excess(norm / max(samples, 1)):
                raise InvalidRequest(f"its input gradient per sample {why}")

        return check
