"""Whether the replicas of a stage hold the same parameters, from the digests their records announce.

Only serving replicas of the run's config that announce a digest count, and only replicas at the same
optimizer step can be compared (a replica one step behind legitimately holds other parameters). Pure
functions over records, shared by ``swarm status`` and ``swarm export``.
"""

from __future__ import annotations

from collections.abc import Iterable

from swarm.discovery.records import StageRecord
from swarm.states import PeerState

# step -> parameter digest -> ids of the peers announcing it at that step (sorted)
StepGroups = dict[int, dict[str, list[str]]]


def step_groups(records: Iterable[StageRecord], *, config_hash: str) -> StepGroups:
    """The digests the serving replicas of ``config_hash`` announce, by step; replicas without one are left
    out (an older peer, or one that has not hashed since its last step)."""
    groups: StepGroups = {}
    for r in sorted(records, key=lambda r: r.peer_id):
        if r.state == PeerState.SERVING and r.config_hash == config_hash and r.param_digest:
            groups.setdefault(r.step, {}).setdefault(r.param_digest, []).append(r.peer_id)
    return groups


def agreement(groups: StepGroups) -> bool | None:
    """False if the replicas at some step announce different digests, True if at least two replicas share a
    step and all agree, None if no two replicas can be compared."""
    if any(len(by_digest) > 1 for by_digest in groups.values()):
        return False
    if any(len(peers) > 1 for by_digest in groups.values() for peers in by_digest.values()):
        return True
    return None


def describe_disagreement(step: int, by_digest: dict[str, list[str]]) -> str:
    """One line naming who holds which parameters, e.g. ``at step 3: a1b2… (p1, p2) vs c3d4… (p3)``."""
    holders = " vs ".join(
        f"{digest} ({', '.join(peers)})" for digest, peers in sorted(by_digest.items())
    )
    return f"at step {step}: {holders}"


def settled_verdict(document: dict) -> tuple[bool | None, str]:
    """Whether each stage's replicas hold the same parameters, from a ``swarm status --json`` document, once
    they have settled (every serving replica at one step, each with its digest): (None, why) if some stage has
    not; else (True or False, one line per stage). A stage with one serving replica agrees with itself."""
    lines, verdict = [], True
    for stage in document["stages"]:
        serving = [r for r in stage["replicas"] if r["state"] == "serving"]
        steps = {r["step"] for r in serving}
        if not serving or len(steps) > 1 or not all(r["param_digest"] for r in serving):
            return None, f"stage {stage['stage']} has not settled: " + ", ".join(
                f"{r['peer_id'][:8]} at step {r['step']}" for r in serving
            )
        # the document's own verdict (see agreement: None for one replica, which agrees with itself)
        if stage["agree"] is not False:
            lines.append(
                f"stage {stage['stage']}: {len(serving)} replica(s) at step {steps.pop()}, same parameters"
            )
        else:
            verdict = False
            lines.append(
                f"stage {stage['stage']}: DIFFERENT parameters at step {steps.pop()}: "
                + ", ".join(f"{r['peer_id'][:8]} {r['param_digest']}" for r in serving)
            )
    return verdict, "; ".join(lines)
