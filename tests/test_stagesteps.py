"""The trainer's view of its stages' optimizer steps (StageSteps), from the records alone: which mode the stages
call for, and which stages a limit on batches ahead cannot count."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import record_wire
from livepeers import closed_port, step_last

from swarm.discovery.records import StageRecord
from swarm.states import PeerState
from swarm.trainer.holdings import Holdings
from swarm.trainer.stagesteps import StageSteps
from swarm.transport.client import ClientPool

RUN_ID = "holdings"


def _record(peer_id: str, stage: int, *, step: int, averaging: bool, state=PeerState.SERVING):
    return StageRecord.from_wire(
        record_wire(peer_id=peer_id, stage=stage, step=step, averaging=averaging, state=state.value)
    )


def _steps(*stages: list[StageRecord]) -> StageSteps:
    records = [{r.peer_id: r for r in stage} for stage in stages]
    return StageSteps(records, clients=None, run_id="r")


@pytest.mark.unit
def test_averaging_stages_step_together_and_count_batches():
    steps = _steps(
        [_record("a", 0, step=4, averaging=True), _record("b", 0, step=3, averaging=True)],
        [_record("c", 1, step=4, averaging=True)],
    )
    assert steps.stages_average()
    assert steps.solo_replicas() == {}
    assert steps.stage_steps() == [4, 4]  # the most advanced replica
    assert steps.stage_steps(every_replica=True) == [3, 4]  # lockstep waits for the last one
    steps.replied(1, 6)
    assert steps.stage_steps() == [4, 6]


@pytest.mark.unit
def test_solo_replicas_are_named_where_a_stage_has_several():
    steps = _steps(
        [_record("a", 0, step=2, averaging=False), _record("b", 0, step=1, averaging=False)],
        # one solo replica steps on every batch: its step counts them
        [_record("c", 1, step=3, averaging=False)],
        # a draining replica no longer serves: it is not counted
        [
            _record("d", 2, step=3, averaging=False),
            _record("e", 2, step=1, averaging=False, state=PeerState.DRAINING),
        ],
    )
    assert not steps.stages_average()
    assert steps.solo_replicas() == {0: 2}


@pytest.mark.unit
def test_one_replica_that_does_not_average_makes_the_stages_not_average():
    steps = _steps(
        [_record("a", 0, step=0, averaging=True), _record("b", 0, step=0, averaging=False)]
    )
    assert not steps.stages_average()
    assert steps.solo_replicas() == {0: 2}
    assert not _steps([]).stages_average()


@pytest.mark.integration
def test_a_replica_gone_before_its_stage_stepped_has_its_gradients_computed_again(
    peers, loop_thread
):
    """Closing a batch, the trainer finds a replica's address refusing connections (the process is gone) while a
    live replica (a real peer, which has taken 2 steps) answers: what the gone replica counted toward batches no
    live replica has stepped on is computed again elsewhere, once; what it had stepped on, what it counted toward
    a batch the live replica stepped on (it may have taken part in that step), what a live replica holds, and
    what a draining replica held (it hands that in itself) are left alone."""
    live_peer = peers(RUN_ID, 1)
    loop_thread.run(step_last(live_peer, 2))
    live = dataclasses.replace(
        _record(live_peer.peer_id, 1, step=0, averaging=True),  # its Info says step 2
        endpoint=live_peer.address.endpoint,
        tls_cert=live_peer.address.tls_cert,
    )
    gone = dataclasses.replace(
        _record("gone", 1, step=1, averaging=True), endpoint=f"127.0.0.1:{closed_port()}"
    )
    drained = dataclasses.replace(
        _record("drained", 1, step=0, averaging=True, state=PeerState.DRAINING),
        endpoint=f"127.0.0.1:{closed_port()}",
    )
    holdings = Holdings(num_stages=2)
    holdings.enabled = True
    redone: list[str] = []

    def redo(microbatch_id: str):
        async def run() -> str:
            redone.append(microbatch_id)
            return live_peer.peer_id

        return run

    holdings.add(
        1, 0, "gone", "stepped-on", redo("stepped-on")
    )  # its replica is at step 1: averaged
    holdings.add(1, 1, "gone", "maybe-in", redo("maybe-in"))  # the live replica stepped on batch 1
    holdings.add(1, 2, "gone", "mb-a", redo("mb-a"))
    holdings.add(1, 2, "gone", "mb-b", redo("mb-b"))
    holdings.add(1, 2, live_peer.peer_id, "mb-c", redo("mb-c"))
    holdings.add(1, 2, "drained", "mb-d", redo("mb-d"))

    async def close() -> None:
        clients = ClientPool()
        records = [{}, {r.peer_id: r for r in (live, gone, drained)}]
        steps = StageSteps(records, clients, RUN_ID, holdings=holdings)
        try:
            await steps.close_batch([None, 2])
            await steps.close_batch([None, 2])  # a second close finds nothing more to do
        finally:
            await clients.close()

    loop_thread.run(close())
    assert redone == ["mb-a", "mb-b"]
    assert holdings.redone == 2
    assert [h.microbatch_id for h in holdings.held_by(1, {live_peer.peer_id})] == [
        "mb-a",
        "mb-b",
        "mb-c",
    ]


@pytest.mark.unit
def test_holdings_are_kept_only_while_bounded_and_forgotten_once_stepped_on():
    async def never() -> str:
        raise AssertionError("not computed again")

    off = Holdings(num_stages=1)
    off.add(
        0, 0, "a", "mb", never
    )  # the trainer runs unbounded (or its stages do not average): nothing kept
    assert off.count() == 0
    holdings = Holdings(num_stages=2)
    holdings.enabled = True
    for step in range(6):
        holdings.add(1, step, "a", f"mb{step}", never)
    holdings.add(1, None, "a", "untagged", never)
    steps = {"a": 3}
    holdings.prune(1, lambda peer: steps.get(peer, 0))
    assert [h.microbatch_id for h in holdings.held_by(1, {"a"})] == ["mb3", "mb4", "mb5"]
    # a replica the trainer no longer sees (step 0) holding a batch far behind the stage's: forgotten
    holdings.add(1, 0, "b", "old", never)
    holdings.prune(1, lambda peer: steps.get(peer, 0))
    assert [h.microbatch_id for h in holdings.held_by(1, {"a", "b"})] == ["mb3", "mb4", "mb5"]


@pytest.mark.integration
def test_a_replica_holding_samples_of_the_batch_is_counted_when_its_record_has_expired(
    peers, loop_thread
):
    """Closing a batch, the trainer asks a replica that counted microbatches of it at the address of its last record
    even when the record is not listed now (on a loaded machine it expires between heartbeats): it answers, so it
    is counted and told the count, and its peers' group waits for it (bench/soak.py lost its samples before)."""
    a, b = peers(RUN_ID, 1), peers(RUN_ID, 1)
    closes: dict[str, list[tuple[int, int]]] = {a.peer_id: [], b.peer_id: []}
    for peer in (a, b):
        peer.executor.close_batch = lambda step, replicas=0, group=None, _id=peer.peer_id, **_: (
            closes[_id].append((step, replicas))
        )
    rec_a, rec_b = (
        dataclasses.replace(
            _record(p.peer_id, 1, step=0, averaging=True),
            endpoint=p.address.endpoint,
            tls_cert=p.address.tls_cert,
        )
        for p in (a, b)
    )
    holdings = Holdings(num_stages=2)
    holdings.enabled = True

    async def never() -> str:
        raise AssertionError("a live replica's part is not computed again")

    holdings.add(1, 1, a.peer_id, "mb-a", never)
    holdings.add(1, 1, b.peer_id, "mb-b", never)

    async def close() -> None:
        clients = ClientPool()
        records = [{}, {rec_a.peer_id: rec_a, rec_b.peer_id: rec_b}]
        steps = StageSteps(records, clients, RUN_ID, holdings=holdings)
        try:
            await steps.close_batch([None, 0])  # both listed
            del records[1][
                rec_b.peer_id
            ]  # b's record expired between heartbeats; b lives and holds samples
            await steps.close_batch([None, 1])
            # a replica that holds nothing of the batch is not looked for beyond the records
            await steps.close_batch([None, 2])
            # b's last record is kept while b holds microbatches of this trainer, and forgotten after
            assert (1, rec_b.peer_id) in steps._last_records
            holdings.release(1, rec_b.peer_id)
            await steps.close_batch([None, 3])
            assert (1, rec_b.peer_id) not in steps._last_records
            assert (1, rec_a.peer_id) in steps._last_records
        finally:
            await clients.close()

    loop_thread.run(close())
    assert closes[a.peer_id][:3] == [(0, 2), (1, 2), (2, 0)]
    assert closes[b.peer_id] == [(0, 2), (1, 2)]
    assert holdings.redone == 0
