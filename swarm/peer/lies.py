"""Fault injection: a peer that lies on purpose (``--lie-output-scale``, ``--lie-gradient-scale``), so tests and
benchmarks can run a real swarm with a dishonest member (tests/test_liars.py, bench/liars.py).

The lies are plausible: finite values of the right shape and dtype, which the trainer's reply checks pass. A
scaled forward output is what spot-checks catch (two other replicas at the same parameters disagree with it); a
scaled input gradient is what the trainer's gradient bound catches (``--max-gradient-ratio``). The liar's own
parameters are trained honestly: it lies to its callers only.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def install_lies(executor, *, output_scale: float = 1.0, gradient_scale: float = 1.0) -> None:
    """Make ``executor`` (a StageExecutor) answer forwards with its output times ``output_scale`` and backwards
    with its input gradient times ``gradient_scale`` (1 = the truth)."""
    if output_scale != 1.0:
        forward = executor.forward

        def lying_forward(microbatch_id, x, **kwargs):
            return output_scale * forward(microbatch_id, x, **kwargs)

        executor.forward = lying_forward
    if gradient_scale != 1.0:
        last, backward = executor.forward_loss_backward, executor.backward

        def lying_last(*args, **kwargs):
            loss, grad_input = last(*args, **kwargs)
            return loss, None if grad_input is None else gradient_scale * grad_input

        def lying_backward(*args, **kwargs):
            grad_input = backward(*args, **kwargs)
            return None if grad_input is None else gradient_scale * grad_input

        executor.forward_loss_backward, executor.backward = lying_last, lying_backward
    if output_scale != 1.0 or gradient_scale != 1.0:
        logger.warning(
            "fault injection: this peer LIES to its callers (outputs x%g, input gradients x%g)",
            output_scale,
            gradient_scale,
        )
