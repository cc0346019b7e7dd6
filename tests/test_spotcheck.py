"""Spot-checks: a peer whose forward results are plausible but wrong (finite, well shaped: the reply checks pass
them) is caught by recomputing its calls at other replicas of its stage at the same parameters, and banned for
the run; honest replicas are never accused (real peers, real DHT, real gRPC; the trainer's pipeline here)."""

from __future__ import annotations

import time

import pytest
import torch
from livepeers import RUN, T

from swarm.discovery.banreports import read_ban_reports
from swarm.trainer.config import PipelineConfig
from swarm.trainer.pipeline import Pipeline
from swarm.trainer.spotcheck import relative_distance

pytestmark = pytest.mark.integration

B = 2
EVALS = 24  # validation calls: they change no parameters, so every replica stays at step 0 with one digest


def test_relative_distance():
    a = torch.ones(4, 8)
    assert relative_distance(a, a.clone()) == 0
    assert relative_distance(a, 1.5 * a) == pytest.approx(0.5)
    assert relative_distance(a, torch.ones(4, 7)) == float("inf")


def _lie(peer) -> None:
    """Make ``peer`` answer every forward with its honest output scaled by 1.5: finite, of the right shape."""
    honest = peer.executor.forward
    peer.executor.forward = lambda mb, x, **kwargs: 1.5 * honest(mb, x, **kwargs)


def _run_evals(loop_thread, last, stage0_peers):
    async def body():
        config = PipelineConfig(spot_check_share=1.0)
        pipeline = Pipeline(last.directory, RUN, config=config, seed=0)
        await pipeline.start()
        try:
            deadline = time.monotonic() + 30
            want = {p.peer_id for p in stage0_peers}
            # every stage-0 replica announced, with its parameter digest
            while not (
                want <= set(pipeline.records[0])
                and all(pipeline.records[0][pid].param_digest for pid in want)
            ):
                assert time.monotonic() < deadline, pipeline.records[0]
                await pipeline._next_refresh(timeout_s=1.0)
            losses = []
            for i in range(EVALS):
                tokens = torch.randint(
                    0, 256, (B, T + 1), generator=torch.Generator().manual_seed(i)
                )
                losses.append(await pipeline.eval_microbatch(tokens))
                await pipeline.spot_checks.settle()
            return losses, pipeline.spot_checks.counts, set(pipeline.banned_for_run)
        finally:
            await pipeline.close()

    return loop_thread.run(body(), timeout_s=300)


def test_a_replica_that_lies_is_caught_by_two_others_and_banned(peers, loop_thread):
    liar, honest_a, honest_b = (peers("spot-lie", 0) for _ in range(3))
    last = peers("spot-lie", 1)
    _lie(liar)
    losses, counts, banned = _run_evals(loop_thread, last, [liar, honest_a, honest_b])
    assert banned == {liar.peer_id} and counts.banned == [liar.peer_id]
    assert counts.mismatched >= 1 and counts.agreed >= 1  # honest pairs were compared, and agreed
    assert all(torch.isfinite(torch.tensor(losses)))
    # the ban is reported in the DHT, signed by the trainer, with its evidence (swarm.discovery.banreports)
    (signed,) = loop_thread.run(read_ban_reports(last.directory))
    report = signed.report
    assert (signed.reporter, report.peer_id, report.kind) == (
        last.peer_id,
        liar.peer_id,
        "mismatch",
    )
    assert set(report.witnesses.split(",")) == {honest_a.peer_id, honest_b.peer_id}
    assert report.result_digest != report.expected_digest and report.distance > 0.4


def test_honest_replicas_agree_and_two_that_disagree_accuse_nobody(peers, loop_thread):
    """Honest replicas at one step agree within the tolerance (no false accusation); with only two replicas, a
    disagreement has no third opinion to decide it: counted, logged, nobody banned."""
    a, b = peers("spot-honest", 0), peers("spot-honest", 0)
    last = peers("spot-honest", 1)
    _, counts, banned = _run_evals(loop_thread, last, [a, b])
    assert banned == set() and counts.mismatched == 0 and counts.agreed >= EVALS // 2
    # every stage-0 call was checked at the other replica; the last stage's single peer has none to compare with
    assert counts.checked == EVALS and counts.inconclusive == EVALS

    _lie(b)
    _, counts, banned = _run_evals(loop_thread, last, [a, b])
    assert banned == set() and counts.mismatched == EVALS and counts.banned == []
