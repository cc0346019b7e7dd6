"""The trainer tells a replica it is alone in its stage (a count of 1 when it closes a batch) only when another
replica of the stage is known to have left (its address refused a connection). A stage whose other records are
merely missing from the trainer's view (they expire between heartbeats on a loaded machine) gets no count, so the
replica goes by its own view of the stage instead of stepping apart from peers that average without it (most of
the soak's missed steps at load 35-40). A real averaging replica in this process, on a real DHT."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import record_wire
from livepeers import MODEL, B, averaging_replica, closed_port, live_record

from swarm.config import RunConfig
from swarm.discovery.records import StageRecord
from swarm.peer.lifecycle import Peer
from swarm.trainer.stagesteps import StageSteps
from swarm.transport.client import ClientPool

pytestmark = pytest.mark.integration

# The batch never fills by samples: the replica takes no step while the test closes its batch.
RUN = RunConfig(model=MODEL, target_batch_size=64 * B, warmup_steps=0)


def test_a_replica_is_told_it_is_alone_only_when_another_left(loop_thread, boot):
    config = averaging_replica("count0", boot, matchmaking_s=1.0)

    async def body() -> tuple[dict[int, int], dict[int, int]]:
        peer = await Peer.create(config, run=RUN)
        clients = ClientPool()
        try:
            live = live_record(peer)
            records = [{}, {live.peer_id: live}]
            steps = StageSteps(records, clients, "count0")
            counted = peer.executor.optimizer._replicas
            # The other replicas' records are missing: no count
            await steps.close_batch([None, 0])
            without_evidence = dict(counted)
            # A replica that answered before now refuses its address: it left, and the live one is alone
            gone = dataclasses.replace(
                StageRecord.from_wire(record_wire(peer_id="gone", stage=1, step=0, averaging=True)),
                endpoint=f"127.0.0.1:{closed_port()}",
            )
            steps.replied(1, 0, "gone")
            records[1]["gone"] = gone
            await steps.close_batch([None, 0])
            return without_evidence, dict(counted)
        finally:
            await clients.close()
            await peer.shutdown()

    without_evidence, with_evidence = loop_thread.run(
        body(), timeout_s=300
    )  # averaging peers start slowly at load 40+
    assert without_evidence == {}
    assert with_evidence == {0: 1}


def test_a_replica_is_told_it_is_alone_when_another_moved_to_another_stage_or_drained_away(
    loop_thread, boot
):
    """Leaving a stage alive counts as leaving it too: a replica seen in stage 1 that announces stage 0 now (an
    operator's move, a rebalancing), or one seen draining whose record is gone since. Without that the replica left
    behind kept expecting its old groupmate: each step waited out a failed all-reduce twice (60 s a step)."""
    config = averaging_replica("count1", boot, matchmaking_s=1.0)

    async def body() -> list[dict[int, int]]:
        peer = await Peer.create(config, run=RUN)
        clients = ClientPool()
        counts = []
        try:
            live = live_record(peer)
            counted = peer.executor.optimizer._replicas
            for left in ("moved", "drained"):
                counted.clear()
                other = StageRecord.from_wire(
                    record_wire(peer_id=left, stage=1, step=0, averaging=True)
                )
                records = [{}, {live.peer_id: live}]
                steps = StageSteps(records, clients, "count1")
                steps.replied(1, 0, left)  # it served stage 1 with the live replica
                if left == "moved":
                    records[0][left] = dataclasses.replace(other, stage=0)
                else:
                    # seen draining (at an address where another peer answers: neither counted nor refused) ...
                    records[1][left] = dataclasses.replace(
                        other,
                        state="draining",
                        endpoint=peer.address.endpoint,
                        tls_cert=peer.address.tls_cert,
                    )
                    await steps.close_batch([None, 0])
                    assert dict(counted) == {}, counted
                    del records[1][left]  # ... then its record is gone
                await steps.close_batch([None, 0])
                counts.append(dict(counted))
            return counts
        finally:
            await clients.close()
            await peer.shutdown()

    moved, drained = loop_thread.run(body(), timeout_s=300)
    assert moved == {0: 1}
    assert drained == {0: 1}
