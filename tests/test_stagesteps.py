"""The trainer's view of its stages' optimizer steps (StageSteps), from the records alone: which mode the stages
call for, and which stages a limit on batches ahead cannot count."""

from __future__ import annotations

import pytest

from swarm.discovery.records import StageRecord
from swarm.states import PeerState
from swarm.trainer.stagesteps import StageSteps

pytestmark = pytest.mark.unit


def _record(peer_id: str, stage: int, *, step: int, averaging: bool, state=PeerState.SERVING):
    return StageRecord(
        peer_id=peer_id,
        endpoint="127.0.0.1:1",
        stage=stage,
        state=state,
        throughput=1.0,
        in_flight=0,
        step=step,
        config_hash="x",
        averaging=averaging,
    )


def _steps(*stages: list[StageRecord]) -> StageSteps:
    async def refresh() -> None:
        pass

    records = [{r.peer_id: r for r in stage} for stage in stages]
    return StageSteps(records, clients=None, run_id="r", refresh=refresh, refresh_s=1.0)


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


def test_one_replica_that_does_not_average_makes_the_stages_not_average():
    steps = _steps(
        [_record("a", 0, step=0, averaging=True), _record("b", 0, step=0, averaging=False)]
    )
    assert not steps.stages_average()
    assert steps.solo_replicas() == {0: 2}
    assert not _steps([]).stages_average()
