"""``swarm status``: what the DHT says about a run, stage by stage."""

from __future__ import annotations

import asyncio

from swarm.discovery.dht import DHTConfig, RunDirectory, start_dht
from swarm.states import PeerState


def format_status(run_id: str, run, stages) -> str:
    lines = [
        f"run '{run_id}': {run.model.num_stages} stages, codec {run.codec}, "
        f"target batch {run.target_batch_size} samples, config {run.fingerprint()}"
    ]
    for index, records in enumerate(stages):
        total = sum(r.throughput for r in records.values() if r.state == PeerState.SERVING)
        lines.append(f"stage {index}: {len(records)} peer(s), {total:.1f} samples/s serving")
        for r in sorted(records.values(), key=lambda r: r.peer_id):
            lines.append(
                f"  {r.peer_id}  {r.endpoint:<21} {r.state:<9} {r.throughput:8.1f} samples/s  "
                f"in flight {r.in_flight:<3} step {r.step}"
            )
    return "\n".join(lines)


async def print_status(run_id: str, dht_config: DHTConfig) -> int:
    dht = await asyncio.to_thread(start_dht, dht_config, client_mode=True)
    try:
        directory = RunDirectory(dht, run_id)
        run = await directory.get_run()
        if run is None:
            print(
                f"no run '{run_id}' is published in this DHT (check --run-id and --initial-peers)"
            )
            return 1
        print(format_status(run_id, run, await directory.all_stages(run.model.num_stages)))
        return 0
    finally:
        dht.shutdown()
