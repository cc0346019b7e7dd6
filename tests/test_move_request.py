"""An operator's move (SIGUSR1 to ``swarm peer``, ``Peer.request_move``) on real peers in this process (real DHT,
real gRPC on port 0), and how a trainer counts a replica that moved: not as one of its old stage's. The move of an
averaging replica during training is in tests/test_averaging.py."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import record_wire
from livepeers import assert_same_tensors, get_state, params, step_last, wait_for_records

from swarm.discovery.records import StageRecord
from swarm.states import PeerState
from swarm.trainer.stagesteps import StageSteps
from swarm.transport.client import ClientPool

pytestmark = pytest.mark.integration


def test_a_requested_move_never_empties_a_stage_and_goes_where_the_peer_is_needed(
    peers, loop_thread
):
    run_id = "asked"
    mover = peers(run_id, 0, drain_notice_s=0.1)
    other = peers(run_id, 1)

    async def request() -> bool:
        return await mover.request_move()

    # The last serving replica of stage 0: the request is refused, the peer serves on where it was.
    assert loop_thread.run(request()) is False
    assert mover.stage_index == 0 and mover.state == PeerState.SERVING

    second = peers(run_id, 0)

    async def body():
        await wait_for_records(mover.directory, 0, lambda r: second.peer_id in r)
        await step_last(other, 2)
        moved = await request()
        return moved, await get_state(mover), await get_state(other)

    moved, moved_state, other_state = loop_thread.run(body())
    assert moved is True
    assert mover.stage_index == 1 and mover.state == PeerState.SERVING
    # it serves stage 1 with the parameters stage 1's replica trained (loaded from it)
    assert_same_tensors(params(moved_state), params(other_state))


def test_a_replica_that_moved_is_not_counted_in_its_old_stage(peers, loop_thread):
    """The trainer's records still list a replica in stage 0 (its record has not expired) while it serves stage 1:
    its Info says so, and the trainer does not take its step for stage 0's."""
    peer = peers("moved", 1)
    loop_thread.run(step_last(peer, 2))
    wire = record_wire(peer_id=peer.peer_id, stage=0, step=0, averaging=True, state="serving")
    stale = dataclasses.replace(
        StageRecord.from_wire(wire),
        endpoint=peer.address.endpoint,
        tls_cert=peer.address.tls_cert,
    )

    async def body():
        clients = ClientPool()
        steps = StageSteps([{peer.peer_id: stale}, {}], clients, "moved")
        try:
            await steps.poll()
            return steps.stage_steps(), steps.stage_steps(every_replica=True)
        finally:
            await clients.close()

    # its Info answered step 2, of stage 1: stage 0's steps stay what its record says
    assert loop_thread.run(body()) == ([0, 0], [0, 0])
