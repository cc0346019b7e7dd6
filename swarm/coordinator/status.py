"""``swarm status``: what the DHT says about a run, stage by stage, as text or as one JSON document.

The JSON document (``swarm status --json``)::

    {"run_id": str, "config": str (RunConfig.fingerprint()), "num_stages": int, "time": float (unix),
     "owner": str | null (fingerprint of the key that signed the run's config),
     "bottleneck": int (the stage with the least serving throughput),
     "stages": [{"stage": int, "throughput": float (samples/s of its serving replicas),
                 "agree": true | false | null,
                 "replicas": [{"peer_id", "endpoint", "state", "step", "param_digest", "throughput",
                               "in_flight", "device", "dtype" ("" = not said), "memory_bytes" (its
                               stage's estimate), "device_memory_bytes" (the device's; 0 = not said),
                               "averaging" (bool), "reachability" ("direct" or "relayed"),
                               "heartbeat_age_s" (seconds since its record was written; null if the
                               record does not say)}]}],
     "trainers": [{"trainer_id", "step", "loss", "val_loss" (null before the first), "tokens_per_s",
                   "microbatches", "heartbeat_age_s"}],
     "reported": [{"peer_id", "stage", "reporters" (peer ids of the trainers that reported it), "avoided" (a
                   quorum of them, or the run's owner: trainers route no work there), "kind", "step", "reason"}]}

``reported`` lists the peers trainers published signed ban reports on (:mod:`swarm.discovery.banreports`),
weighed with the trainers' default quorum (:data:`STATUS_QUORUM`). ``agree`` (see
:mod:`swarm.coordinator.agreement`): false if serving replicas at one step announce different
parameter digests, true if at least two are comparable and all agree, null if none are. With ``--watch S``
the status is printed again every S seconds (``--json``: one document per line) until interrupted.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from hivemind.utils import get_dht_time

from swarm.coordinator.agreement import agreement, describe_disagreement, step_groups
from swarm.discovery.banreports import read_ban_reports, weigh_reports
from swarm.discovery.dht import DHTConfig, RunDirectory, list_runs, start_dht
from swarm.states import PeerState, Reachability
from swarm.trainer.config import PipelineConfig

# the quorum status weighs ban reports by: the trainers' default
STATUS_QUORUM = PipelineConfig().ban_report_quorum


def reported_peers(verdicts) -> list[dict[str, Any]]:
    """The ``reported`` part of the status document from :func:`weigh_reports`'s verdicts."""
    out = []
    for peer, verdict in sorted(verdicts.items()):
        latest = max(verdict.reports, key=lambda r: r.reported_s)
        out.append(
            {
                "peer_id": peer,
                "stage": latest.stage,
                "reporters": sorted(verdict.reporters),
                "avoided": verdict.avoid,
                "kind": latest.kind,
                "step": latest.step,
                "reason": latest.reason,
            }
        )
    return out


def _age(announced_s: float, now: float) -> float | None:
    return None if not announced_s else round(max(0.0, now - announced_s), 1)


def status_document(
    run_id: str, run, stages, trainers=None, reported=None, owner: str | None = None
) -> dict[str, Any]:
    """The status of ``run`` as plain JSON-ready data (the schema in the module docstring); ``trainers``:
    the run's trainer records by id; ``owner``: the fingerprint of the run config's signer; ``reported``:
    :func:`reported_peers`."""
    out, now = [], get_dht_time()
    for index, records in enumerate(stages):
        groups = step_groups(records.values(), config_hash=run.fingerprint())
        replicas = [
            {
                "peer_id": r.peer_id,
                "endpoint": r.endpoint,
                "state": PeerState(r.state).value,
                "step": r.step,
                "param_digest": r.param_digest,
                "throughput": r.throughput,
                "in_flight": r.in_flight,
                "device": r.device,
                "dtype": r.dtype,
                "memory_bytes": r.memory_bytes,
                "device_memory_bytes": r.device_memory_bytes,
                "averaging": r.averaging,
                "reachability": Reachability(r.reachability).value,
                "heartbeat_age_s": _age(r.announced_s, now),
            }
            for r in sorted(records.values(), key=lambda r: r.peer_id)
        ]
        out.append(
            {
                "stage": index,
                "throughput": serving_throughput(records),
                "agree": agreement(groups),
                "replicas": replicas,
            }
        )
    return {
        "run_id": run_id,
        "config": run.fingerprint(),
        "num_stages": run.model.num_stages,
        "time": time.time(),
        "owner": owner,
        "bottleneck": bottleneck(stages),
        "stages": out,
        "trainers": [
            {
                **{k: v for k, v in t.to_wire().items() if k not in ("version", "announced_s")},
                "heartbeat_age_s": _age(t.announced_s, now),
            }
            for t in sorted((trainers or {}).values(), key=lambda t: t.trainer_id)
        ],
        "reported": list(reported or []),
    }


def serving_throughput(records) -> float:
    """Samples/s a stage serves: the sum over its serving replicas (draining and starting ones left out)."""
    return sum(r.throughput for r in records.values() if r.state == PeerState.SERVING)


def bottleneck(stages) -> int:
    """The stage with the least serving throughput (the first of equals): what limits the swarm's speed."""
    totals = [serving_throughput(records) for records in stages]
    return totals.index(min(totals))


def _agreement_line(run, records) -> str:
    groups = step_groups(records.values(), config_hash=run.fingerprint())
    verdict = agreement(groups)
    if verdict is None:
        return "replicas: no two at one step to compare"
    if verdict:
        steps = sorted(s for s, d in groups.items() if len(next(iter(d.values()))) > 1)
        return f"replicas agree (step {', '.join(map(str, steps))})"
    return "replicas DISAGREE " + "; ".join(
        describe_disagreement(step, by_digest)
        for step, by_digest in sorted(groups.items())
        if len(by_digest) > 1
    )


def format_status(
    run_id: str, run, stages, trainers=None, reported=None, owner: str | None = None
) -> str:
    now = get_dht_time()
    lines = [
        f"run '{run_id}': {run.model.num_stages} stages, {run.compression_scheme()}, "
        f"target batch {run.target_batch_size} samples, config {run.fingerprint()}"
        + (f", owner {owner}" if owner else "")
    ]
    for index, records in enumerate(stages):
        total = serving_throughput(records)
        lines.append(
            f"stage {index}: {len(records)} peer(s), {total:.1f} samples/s serving, "
            f"{_agreement_line(run, records)}"
        )
        for r in sorted(records.values(), key=lambda r: r.peer_id):
            lines.append(
                f"  {r.peer_id}  {r.endpoint:<21} {r.state:<9} {r.throughput:8.1f} samples/s  "
                f"in flight {r.in_flight:<3} step {r.step:<6} digest {r.param_digest or '-'}"
                f"  {_device_text(r)}  heartbeat {_age_text(r.announced_s, now)}"
                f"{_relay_text(r)}"
            )
    for t in sorted((trainers or {}).values(), key=lambda t: t.trainer_id):
        val = "" if t.val_loss is None else f" | val {t.val_loss:.3f}"
        loss = "-" if t.loss is None else f"{t.loss:.3f}"
        lines.append(
            f"trainer {t.trainer_id}: step {t.step} | loss {loss}{val} | {t.tokens_per_s:,.0f} tokens/s"
            f" | heartbeat {_age_text(t.announced_s, now)}"
        )
    for r in reported or []:
        lines.append(
            f"reported peer {r['peer_id']} (stage {r['stage']}) by {len(r['reporters'])} trainer(s), "
            f"{'AVOIDED' if r['avoided'] else 'suspect (checked on every call)'}: {r['kind']} at step "
            f"{r['step']}: {r['reason']}"
        )
    if stages:
        slowest = bottleneck(stages)
        lines.append(
            f"bottleneck: stage {slowest} ({serving_throughput(stages[slowest]):.1f} samples/s serving)"
        )
    return "\n".join(lines)


def _device_text(r) -> str:
    """e.g. "cuda:0 bf16 2.1/80.0 GiB": device, compute dtype, the stage's estimate / the device's memory."""
    parts = [r.device or "-"]
    if r.dtype:
        parts.append(r.dtype)
    if r.memory_bytes:
        total = f"/{r.device_memory_bytes / (1 << 30):.1f}" if r.device_memory_bytes else ""
        parts.append(f"{r.memory_bytes / (1 << 30):.1f}{total} GiB")
    return " ".join(parts)


def _age_text(announced_s: float, now: float) -> str:
    age = _age(announced_s, now)
    return "-" if age is None else f"{age:.0f}s ago"


async def read_status(directory: RunDirectory):
    """``(run, stages, trainers, reported)`` of the directory's run as the DHT has them now, or None if it has no
    such run (what :func:`status_document` and :func:`format_status` take)."""
    run = await directory.get_run()
    if run is None:
        return None
    stages, trainers, reports = await asyncio.gather(
        directory.all_stages(run.model.num_stages),
        directory.trainer_records(),
        read_ban_reports(directory),
    )
    trusted = {directory.owner} if directory.owner else set()
    verdicts = weigh_reports(reports, quorum=STATUS_QUORUM, trusted=trusted)
    return run, stages, trainers, reported_peers(verdicts)


async def print_runs(dht_config: DHTConfig, *, as_json: bool = False) -> int:
    """Print the runs published in the DHT (``swarm status --list-runs``)."""
    dht = await asyncio.to_thread(start_dht, dht_config, client_mode=True)
    try:
        runs = await list_runs(dht)
    finally:
        dht.shutdown()
    if as_json:
        print(json.dumps({"runs": [{"run_id": k, **v} for k, v in sorted(runs.items())]}))
    elif not runs:
        print("no run is published in this DHT (check --initial-peers)")
    else:
        for run_id, run in sorted(runs.items()):
            owners = ", ".join(run["owners"])
            print(
                f"run '{run_id}': {run['num_stages']} stages, config {run['config']}, owner {owners}"
            )
    return 0


async def print_status(
    run_id: str, dht_config: DHTConfig, *, as_json: bool = False, watch_s: float | None = None
) -> int:
    """Print the run's status once, or every ``watch_s`` seconds until interrupted."""
    if watch_s is not None and not watch_s > 0:
        raise ValueError(f"--watch takes a number of seconds > 0, got {watch_s}")
    dht = await asyncio.to_thread(start_dht, dht_config, client_mode=True)
    try:
        directory = RunDirectory(dht, run_id, run_owner=dht_config.run_owner)
        while True:
            found = await read_status(directory)
            if found is None:
                # stderr: stdout holds only the status (a script reading --json sees no stray text)
                runs = sorted(await list_runs(dht))
                known = f"; published runs: {', '.join(runs)}" if runs else ""
                print(
                    f"swarm status: no run '{run_id}' is published in this DHT (check --run-id and "
                    f"--initial-peers{known})",
                    file=sys.stderr,
                )
                return 1
            if as_json:
                print(
                    json.dumps(status_document(run_id, *found, owner=directory.owner)), flush=True
                )
            else:
                print(format_status(run_id, *found, owner=directory.owner), flush=True)
            if watch_s is None:
                return 0
            await asyncio.sleep(watch_s)  # the period asked for
            if not as_json:
                print(flush=True)
    finally:
        dht.shutdown()


def _relay_text(r) -> str:
    """How callers reach a peer, when not simply at its endpoint: through a relay, or not at all."""
    if r.reachability != Reachability.RELAYED:
        return ""  # a relay's port is in --json (relay_port)
    if r.relay_peer_id:
        return f"  relayed (not reachable directly; its endpoint is on relay {r.relay_peer_id})"
    return "  relayed, no relay now (not reachable: gets no work)"
