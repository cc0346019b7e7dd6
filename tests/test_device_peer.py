"""A live peer (real DHT, real gRPC on port 0) computing in bf16 on the CPU: its record states device, dtype and
memory and `swarm status` shows them; its stage trains through the wire; a peer whose stage does not fit the
memory it is given refuses to start, saying what to change, and leaves nothing running."""

from __future__ import annotations

import pytest
from conftest import record_wire
from livepeers import MODEL, step_last, wait_for_records

from swarm.coordinator.status import format_status, status_document
from swarm.discovery.dht import RunDirectory
from swarm.discovery.records import StageRecord
from swarm.peer.memory import InsufficientMemory

pytestmark = pytest.mark.integration


def test_bf16_peer_announces_device_dtype_and_memory_and_trains(loop_thread, peers):
    peer = peers("bf16", 1, device="cpu", dtype="bf16")
    directory = RunDirectory(peer.dht, "bf16")
    assert peer.memory_bytes > 0

    async def steps_and_status():
        await step_last(peer, 2)  # two optimizer steps through the wire, in bf16
        records = await wait_for_records(
            directory, 1, lambda r: peer.peer_id in r and r[peer.peer_id].step == 2
        )
        run = await directory.get_run()
        stages = await directory.all_stages(MODEL.num_stages)
        return (
            records[peer.peer_id],
            status_document("bf16", run, stages),
            format_status("bf16", run, stages),
        )

    record, doc, text = loop_thread.run(steps_and_status())
    assert (record.device, record.dtype) == ("cpu", "bf16")
    assert record.memory_bytes == peer.memory_bytes
    assert record.device_memory_bytes > record.memory_bytes
    (replica,) = doc["stages"][1]["replicas"]
    assert replica["dtype"] == "bf16" and replica["memory_bytes"] == peer.memory_bytes
    assert f"cpu bf16 {peer.memory_bytes / (1 << 30):.1f}/" in text


def test_older_records_without_the_fields_still_parse():
    wire = StageRecord.from_wire(
        record_wire(device="cuda:0", dtype="fp16", memory_bytes=5, device_memory_bytes=9)
    ).to_wire()
    assert StageRecord.from_wire(wire).dtype == "fp16"
    for key in ("dtype", "memory_bytes", "device_memory_bytes"):
        del wire[key]
    old = StageRecord.from_wire(wire)
    assert (old.dtype, old.memory_bytes, old.device_memory_bytes) == ("", 0, 0)


def test_a_peer_whose_stage_does_not_fit_refuses_to_start(peers):
    with pytest.raises(
        InsufficientMemory, match=r"stage 0 needs about .*--memory-limit-bytes only"
    ):
        peers("tight", 0, memory_limit_bytes=1 << 20)
