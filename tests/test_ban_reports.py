"""Ban reports (swarm.discovery.banreports, swarm.trainer.reports): a trainer's signed report of a peer it banned
is read by the others through a real hivemind DHT; a report cannot be forged in another reporter's name, filed for
another peer's slot, or grow past its bound; one reporter alone does not make others avoid a peer (it becomes a
suspect, checked on every call), a quorum of distinct reporters or the run's owner does."""

from __future__ import annotations

import asyncio
import time

import hivemind
import pytest
import torch
from hivemind.utils import get_dht_time
from livepeers import RUN, T

from swarm.coordinator.status import format_status, read_status, status_document
from swarm.discovery.banreports import (
    MAX_REPORT_BYTES,
    BanReport,
    SignedReport,
    ban_reports_key,
    publish_ban_report,
    read_ban_reports,
    weigh_reports,
)
from swarm.discovery.dht import DHTConfig, RunDirectory, start_dht
from swarm.identity import Identity
from swarm.trainer.config import PipelineConfig
from swarm.trainer.pipeline import Pipeline
from swarm.trainer.reports import ReportBook

LIAR, HONEST = "a1" * 8, "b2" * 8


def _report(peer_id: str = LIAR, run_id: str = "bans", **overrides) -> BanReport:
    fields = dict(
        peer_id=peer_id,
        run_id=run_id,
        stage=0,
        kind="mismatch",
        reason="spot-check: two replicas agree, it does not",
        microbatch_id="spot-check",
        step=4,
        param_digest="0123456789abcdef",
        result_digest="aa" * 8,
        expected_digest="bb" * 8,
        distance=0.5,
        witnesses=f"{'c3' * 8},{'d4' * 8}",
    )
    return BanReport.make(**{**fields, **overrides})


def _signed(reporter: Identity, peer_id: str = LIAR) -> SignedReport:
    return SignedReport(reporter.peer_id, reporter.fingerprint, _report(peer_id))


@pytest.mark.unit
def test_a_quorum_of_distinct_reporters_or_a_trusted_one_makes_a_peer_avoided():
    a, b, c = Identity.ephemeral(), Identity.ephemeral(), Identity.ephemeral()
    # one reporter, however many times it reports: a suspect only
    one = weigh_reports([_signed(a), _signed(a)], quorum=2)
    assert one[LIAR].reporters == {a.peer_id} and not one[LIAR].avoid
    two = weigh_reports([_signed(a), _signed(b)], quorum=2)
    assert two[LIAR].avoid and two[LIAR].reporters == {a.peer_id, b.peer_id}
    # the run's owner (by fingerprint) or the reader itself (by peer id) counts alone
    assert weigh_reports([_signed(c)], quorum=3, trusted={c.fingerprint})[LIAR].avoid
    assert weigh_reports([_signed(c)], quorum=3, trusted={c.peer_id})[LIAR].avoid
    # a run with a caller list: only listed reporters count
    listed = weigh_reports([_signed(a), _signed(b)], quorum=2, admitted={a.peer_id})
    assert listed[LIAR].reporters == {a.peer_id} and not listed[LIAR].avoid
    # a peer reporting itself counts for nothing
    own = SignedReport(LIAR, "0" * 32, _report())
    assert weigh_reports([own], quorum=1) == {}
    with pytest.raises(ValueError, match="quorum must be >= 1"):
        weigh_reports([], quorum=0)


@pytest.mark.unit
def test_a_report_is_checked_field_by_field_and_bounded():
    wire = _report().to_wire()
    assert BanReport.from_wire(wire).peer_id == LIAR
    with pytest.raises(ValueError, match="kind"):
        BanReport.from_wire({**wire, "kind": "dislike"})
    with pytest.raises(ValueError, match="peer id"):
        BanReport.from_wire({**wire, "peer_id": "someone"})
    with pytest.raises(ValueError, match="at most"):
        BanReport.from_wire({**wire, "reason": "x" * 1000})
    with pytest.raises(ValueError, match=f"at most {MAX_REPORT_BYTES} bytes"):
        BanReport.from_wire({**wire, "padding": "x" * MAX_REPORT_BYTES})
    # make() cuts long texts to their bound instead of failing the ban
    assert len(_report(reason="y" * 10_000).reason) == 240


@pytest.fixture(scope="module")
def nodes():
    """Three trainers' DHT nodes (each with its own key, the first the bootstrap) and a rogue node running bare
    hivemind without any validator."""
    first = start_dht(DHTConfig())
    maddrs = tuple(str(a) for a in first.get_visible_maddrs())
    second, third = (
        start_dht(DHTConfig(initial_peers=maddrs)),
        start_dht(DHTConfig(initial_peers=maddrs)),
    )
    rogue = hivemind.DHT(
        initial_peers=list(maddrs), start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
    yield first, second, third, rogue
    for node in (rogue, third, second, first):
        node.shutdown()


@pytest.mark.integration
def test_reports_are_published_read_and_weighed_across_trainers(nodes):
    first, second, third, _ = nodes
    run_id = "bans-quorum"

    async def go():
        readers = [RunDirectory(n, run_id) for n in (first, second, third)]
        book = ReportBook(readers[2], quorum=2, ttl_s=60)
        assert await publish_ban_report(readers[0], _report(run_id=run_id), ttl_s=60)
        await book.refresh(admitted=None)
        after_one = (set(book.suspects), set(book.avoided))
        seen = await read_ban_reports(readers[2])
        assert await publish_ban_report(readers[1], _report(run_id=run_id), ttl_s=60)
        await book.refresh(admitted=None)
        after_two = (set(book.suspects), set(book.avoided), book.verdicts[LIAR].reporters)
        # a run whose caller list names only the first trainer: the second's report does not count
        await book.refresh(admitted=frozenset({first.swarm_identity.peer_id}))
        return after_one, seen, after_two, set(book.avoided)

    after_one, seen, after_two, listed = asyncio.run(go())
    assert after_one == ({LIAR}, set())  # one reporter: a suspect, not avoided
    (signed,) = seen
    assert signed.reporter == first.swarm_identity.peer_id
    assert signed.report.result_digest == "aa" * 8 and signed.report.step == 4
    ids = {first.swarm_identity.peer_id, second.swarm_identity.peer_id}
    assert after_two == (set(), {LIAR}, ids)
    assert listed == set()


@pytest.mark.integration
def test_forged_misfiled_and_oversized_reports_are_refused(nodes):
    first, second, third, rogue = nodes
    run_id = "bans-forged"
    victim = first.swarm_identity  # an honest trainer whose name the forgers use

    async def go():
        key, later = ban_reports_key(run_id), get_dht_time() + 600
        slot = victim.owner_marker + b"/" + HONEST.encode()
        wire = _report(HONEST, run_id).to_wire()
        # another trainer's node cannot sign under the victim's marker; a rogue node without a validator tries too
        await second.store(key, wire, later, subkey=slot, return_future=True)
        await rogue.store(key, wire, later, subkey=slot, return_future=True)
        # unsigned, under no marker
        await rogue.store(key, wire, later, subkey=HONEST.encode(), return_future=True)
        mine = second.swarm_identity.owner_marker
        # signed, but filed in another peer's slot, or about another run, or oversized
        await second.store(key, wire, later, subkey=mine + b"/" + LIAR.encode(), return_future=True)
        other_run = _report(HONEST, "elsewhere").to_wire()
        await second.store(
            key, other_run, later, subkey=mine + b"/" + HONEST.encode(), return_future=True
        )
        huge = {**wire, "padding": "x" * 4 * MAX_REPORT_BYTES}
        theirs = third.swarm_identity.owner_marker + b"/" + HONEST.encode()
        await third.store(key, huge, later, subkey=theirs, return_future=True)
        # and the victim's own, real report beside them
        assert await publish_ban_report(
            RunDirectory(first, run_id), _report(LIAR, run_id), ttl_s=60
        )
        return await read_ban_reports(RunDirectory(first, run_id))

    (only,) = asyncio.run(go())
    assert (only.reporter, only.report.peer_id) == (victim.peer_id, LIAR)


@pytest.mark.integration
def test_the_run_owners_report_counts_alone(nodes):
    first, second, _, _ = nodes
    run_id = "bans-owner"

    async def go():
        owner = RunDirectory(first, run_id)
        await owner.publish_run(RUN, ttl_s=60)
        reader = RunDirectory(second, run_id)
        await reader.wait_for_run(timeout_s=30)
        assert reader.owner == first.swarm_identity.fingerprint
        await publish_ban_report(owner, _report(HONEST, run_id), ttl_s=60)
        book = ReportBook(reader, quorum=5, ttl_s=60)
        await book.refresh(admitted=None)
        return set(book.avoided), await read_status(reader)

    avoided, found = asyncio.run(go())
    assert avoided == {HONEST}
    # `swarm status` shows it, as text and in the JSON document
    (entry,) = status_document(run_id, *found)["reported"]
    assert entry["peer_id"] == HONEST and entry["avoided"] and entry["kind"] == "mismatch"
    assert entry["reporters"] == [first.swarm_identity.peer_id]
    text = format_status(run_id, *found)
    assert f"reported peer {HONEST} (stage 0) by 1 trainer(s), AVOIDED: mismatch at step 4" in text


@pytest.mark.integration
def test_a_trainer_checks_a_suspect_on_every_call_and_avoids_a_peer_a_quorum_reported(
    peers, loop_thread, boot
):
    """Real peers: one report makes a peer a suspect (still routed, every forward to it spot-checked, and an honest
    one survives the checks); a second reporter makes the trainer route around it."""
    run_id = "reports-route"
    accused, other, last = peers(run_id, 0), peers(run_id, 0), peers(run_id, 1)
    node = start_dht(DHTConfig(initial_peers=boot))  # the trainer's own node and key
    tokens = [
        torch.randint(0, 256, (2, T + 1), generator=torch.Generator().manual_seed(i))
        for i in range(12)
    ]

    async def body():
        config = PipelineConfig(spot_check_share=0.0, ban_report_quorum=2)
        pipeline = Pipeline(RunDirectory(node, run_id), RUN, config=config, seed=0)
        await pipeline.start()
        try:
            await publish_ban_report(other.directory, _report(accused.peer_id, run_id), ttl_s=60)
            deadline = time.monotonic() + 30
            # (both stage-0 replicas announced with their parameter digests: spot-checks compare by them)
            while accused.peer_id not in pipeline.reports.suspects or not all(
                pipeline.records[0].get(p.peer_id) and pipeline.records[0][p.peer_id].param_digest
                for p in (accused, other)
            ):
                assert time.monotonic() < deadline
                await pipeline._next_refresh(timeout_s=1.0)
            assert accused.peer_id in pipeline.router.peers(0)
            for t in tokens:
                await pipeline.eval_microbatch(t)
            await pipeline.spot_checks.settle()
            counts = pipeline.spot_checks.counts
            suspect = (counts.checked, counts.agreed, set(pipeline.banned_for_run))
            await publish_ban_report(last.directory, _report(accused.peer_id, run_id), ttl_s=60)
            while accused.peer_id not in pipeline.reports.avoided:
                assert time.monotonic() < deadline
                await pipeline._next_refresh(timeout_s=1.0)
            before = accused.executor.microbatches_applied
            for i, t in enumerate(tokens[:6]):
                await pipeline.train_microbatch(f"mb{i}", t)
            return (
                suspect,
                set(pipeline.router.peers(0)),
                before,
                accused.executor.microbatches_applied,
            )
        finally:
            await pipeline.close()

    try:
        (checked, agreed, banned), routed, before, after = loop_thread.run(body(), timeout_s=300)
    finally:
        node.shutdown()
    # with a spot-check share of 0, only the calls to the suspect were checked; it is honest: they agreed
    assert checked >= 1 and agreed == checked and banned == set()
    assert routed == {other.peer_id} and after == before  # avoided: no more work
