"""The names a stage's averaging goes by in hivemind: its run id prefix and the group key of each step."""

from __future__ import annotations

STEP_KEY_BITS = 32


def stage_run_id(run_id: str, stage: int) -> str:
    """hivemind run id of one stage's averaging (hivemind forbids '.' in its prefixes)."""
    return f"{run_id.replace('.', '_')}_stage{stage}"


def step_group_bits(step: int) -> str:
    """The all-reduce group key bits of optimizer step ``step``: replicas at different steps never share a group
    (a replica one step behind would otherwise add its gradients of another batch to its peers' average)."""
    return format(step % 2**STEP_KEY_BITS, f"0{STEP_KEY_BITS}b")
