"""``swarm status``: what the DHT says about a run, stage by stage, as text or as one JSON document.

The JSON document (``swarm status --json``)::

    {"run_id": str, "config": str (RunConfig.fingerprint()), "num_stages": int, "time": float (unix),
     "bottleneck": int (the stage with the least serving throughput),
     "stages": [{"stage": int, "throughput": float (samples/s of its serving replicas),
                 "agree": true | false | null,
                 "replicas": [{"peer_id", "endpoint", "state", "step", "param_digest", "throughput",
                               "in_flight"}]}],
     "trainers": [{"trainer_id", "step", "loss", "val_loss" (null before the first), "tokens_per_s",
                   "microbatches"}]}

``agree`` (see :mod:`swarm.coordinator.agreement`): false if serving replicas at one step announce different
parameter digests, true if at least two are comparable and all agree, null if none are. With ``--watch S``
the status is printed again every S seconds (``--json``: one document per line) until interrupted.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from swarm.coordinator.agreement import agreement, describe_disagreement, step_groups
from swarm.discovery.dht import DHTConfig, RunDirectory, list_runs, start_dht
from swarm.states import PeerState


def status_document(run_id: str, run, stages, trainers=None) -> dict[str, Any]:
    """The status of ``run`` as plain JSON-ready data (the schema in the module docstring); ``trainers``:
    the run's trainer records by id."""
    out = []
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
        "bottleneck": bottleneck(stages),
        "stages": out,
        "trainers": [
            {key: value for key, value in t.to_wire().items() if key != "version"}
            for t in sorted((trainers or {}).values(), key=lambda t: t.trainer_id)
        ],
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


def format_status(run_id: str, run, stages, trainers=None) -> str:
    lines = [
        f"run '{run_id}': {run.model.num_stages} stages, {run.compression_scheme()}, "
        f"target batch {run.target_batch_size} samples, config {run.fingerprint()}"
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
            )
    for t in sorted((trainers or {}).values(), key=lambda t: t.trainer_id):
        val = "" if t.val_loss is None else f" | val {t.val_loss:.3f}"
        loss = "-" if t.loss is None else f"{t.loss:.3f}"
        lines.append(
            f"trainer {t.trainer_id}: step {t.step} | loss {loss}{val} | {t.tokens_per_s:,.0f} tokens/s"
        )
    if stages:
        slowest = bottleneck(stages)
        lines.append(
            f"bottleneck: stage {slowest} ({serving_throughput(stages[slowest]):.1f} samples/s serving)"
        )
    return "\n".join(lines)


async def read_status(directory: RunDirectory):
    """``(run, stages, trainers)`` of the directory's run as the DHT has them now, or None if it has no such
    run (what :func:`status_document` and :func:`format_status` take)."""
    run = await directory.get_run()
    if run is None:
        return None
    stages, trainers = await asyncio.gather(
        directory.all_stages(run.model.num_stages), directory.trainer_records()
    )
    return run, stages, trainers


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
                print(json.dumps(status_document(run_id, *found)), flush=True)
            else:
                print(format_status(run_id, *found), flush=True)
            if watch_s is None:
                return 0
            await asyncio.sleep(watch_s)  # the period asked for
            if not as_json:
                print(flush=True)
    finally:
        dht.shutdown()
