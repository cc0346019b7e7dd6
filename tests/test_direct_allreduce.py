"""Replicas that average directly (``--all-reduce direct``, swarm.averaging.direct): the trainer's close names the
group, and the replicas average over their own gRPC servers with no matchmaking. Real peers in this process on a
real DHT and real gRPC; the closes come through the trainer's own StageSteps or its client."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from livepeers import (
    B,
    assert_one_state,
    averaging_replicas,
    live_record,
    one_microbatch,
    until_step,
)

from swarm.averaging.direct import OwnedParts, part_spans
from swarm.averaging.optimizer import DIRECT_PROGRESS_REFRESH_S
from swarm.errors import AllReduceFailed, InvalidRequest, SwarmError
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.trainer.holdings import Holdings
from swarm.trainer.stagesteps import StageSteps
from swarm.transport.callers import caller_token
from swarm.transport.client import ClientPool, PeerClient

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("numel,parts", [(10, 3), (2, 3), (0, 2), (1_000_003, 4)])
def test_parts_cover_the_gradients_once_in_order(numel, parts):
    spans = part_spans(numel, parts)
    assert len(spans) == parts and spans[0][0] == 0 and spans[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    sizes = [end - start for start, end in spans]
    assert max(sizes) - min(sizes) <= 1


def test_an_owned_part_averages_the_shares_over_their_samples_and_refuses_what_does_not_belong():
    members = ("a", "b", "c")

    async def body():
        parts = OwnedParts("b", timeout_s=5.0, current_step=lambda: 3)
        share = {m: torch.full((4,), float(i + 1)) for i, m in enumerate(members)}
        samples = {"a": 2, "b": 0, "c": 6}
        waits = [
            asyncio.ensure_future(parts.contribute(3, members, 1, m, share[m], samples[m]))
            for m in ("a", "b")
        ]
        await asyncio.sleep(0)  # both shares are in; the part waits for c's
        assert not any(w.done() for w in waits)
        with pytest.raises(InvalidRequest, match="twice"):
            await parts.contribute(3, members, 1, "a", share["a"], 2)
        last = await parts.contribute(3, members, 1, "c", share["c"], 6)
        first = await asyncio.gather(*waits)
        meta = pb.ReduceMeta(step=3, members=list(members), part=1)
        refusals = []
        for sender, change in (("x", {}), ("a", dict(part=0)), ("a", dict(step=2))):
            bad = pb.ReduceMeta()
            bad.CopyFrom(meta)
            for field, value in change.items():
                setattr(bad, field, value)
            with pytest.raises(SwarmError) as refused:
                parts.check(bad, sender, numel=12)
            refusals.append(refused.value)
        return last, first, parts.check(meta, "a", numel=12), refusals

    last, first, part_len, refusals = asyncio.run(body())
    want = (1 + 2 + 3) / (2 + 0 + 6)  # shares are sums already: their sum over all their samples
    assert torch.equal(last, torch.full((4,), want)) and all(torch.equal(f, last) for f in first)
    assert part_len == 4  # part 1 of 12 values in 3 parts
    stranger, not_its_part, step_taken = refusals
    assert isinstance(stranger, InvalidRequest) and "not a member" in str(stranger)
    assert isinstance(not_its_part, InvalidRequest) and "not this peer's" in str(not_its_part)
    assert isinstance(step_taken, AllReduceFailed) and "step 3 already" in str(step_taken)


def test_a_part_whose_shares_do_not_all_come_fails_for_every_waiting_member_naming_the_missing():
    async def body():
        parts = OwnedParts("b", timeout_s=0.3, current_step=lambda: 0)
        waits = [parts.contribute(0, ("a", "b", "c"), 1, m, torch.zeros(2), 1) for m in ("a", "b")]
        return await asyncio.gather(*waits, return_exceptions=True)

    outcomes = asyncio.run(body())
    assert len(outcomes) == 2
    for failed in outcomes:
        assert isinstance(failed, AllReduceFailed), failed
        assert "the shares of ['c'] did not come within 0.3s" in str(failed)


RUN_ID = "direct"


async def _sums(peer) -> tuple[torch.Tensor, int]:
    """The replica's gradient sums (flat, in its optimizer's order) and their samples, read on its compute thread."""
    from swarm.averaging import hivemind_private as hp

    opt = peer.executor.optimizer

    def read():
        accs = hp.gradient_accumulators(opt.opt)
        return torch.cat([a.detach().reshape(-1).clone() for a in accs]), opt.local_samples

    return await peer._worker.compute_urgent(read)


async def _averaged(peer) -> torch.Tensor:
    """What the replica's last step loaded as the averaged gradient (flat, in its optimizer's order)."""

    def read():
        with peer.executor.optimizer.opt.grad_averager.get_tensors() as tensors:
            return torch.cat([t.detach().reshape(-1).clone() for t in tensors])

    return await peer._worker.compute_urgent(read)


def test_replicas_average_with_the_group_the_close_names_and_refuse_strangers(loop_thread, boot):
    """Three replicas hold 2, 1 and 0 microbatches of the batch; the trainer's close names all three: they step
    together on the global mean (sums over samples) and end bit-identical. A stranger's share and a malformed one
    are refused with what is wrong, and the replicas go on serving."""

    async def body():
        replicas = await averaging_replicas(3, RUN_ID, boot, all_reduce="direct")
        clients = ClientPool()
        try:
            await one_microbatch(replicas[0], seed=0)
            await one_microbatch(replicas[0], seed=1)
            await one_microbatch(replicas[1], seed=2)
            held = [await _sums(r) for r in replicas]

            # A stranger (this process's own identity) and a member sending a share of the wrong length.
            ids = sorted(r.peer_id for r in replicas)
            owner = next(r for r in replicas if r.peer_id == ids[0])
            member = next(r for r in replicas if r.peer_id == ids[1])
            numel = owner.executor.optimizer.direct.numel
            part = part_spans(numel, 3)[0]
            meta = pb.ReduceMeta(
                protocol_version=PROTOCOL_VERSION,
                run_id=RUN_ID,
                stage=1,
                step=0,
                members=ids,
                part=0,
                samples=B,
            )
            errors = []
            stranger = PeerClient(owner.address)
            as_member = ClientPool(token=caller_token(member.identity))
            try:
                for client, share in (
                    (stranger, torch.zeros(part[1] - part[0])),
                    (as_member.get(owner.address), torch.zeros(part[1] - part[0] + 1)),
                ):
                    with pytest.raises(SwarmError) as refused:
                        await client.reduce_part(meta, share, timeout_s=10)
                    errors.append(refused.value)
            finally:
                await stranger.close()
                await as_member.close()

            records = {r.peer_id: live_record(r) for r in replicas}
            steps = StageSteps([{}, records], clients, RUN_ID)
            await steps.close_batch([None, 0], wait_for_step_s=20.0)
            for r in replicas:
                await until_step(r, 1, "the replica stepped on the group's average")
            await assert_one_state(replicas)
            return held, [await _averaged(r) for r in replicas], errors
        finally:
            await clients.close()
            for r in replicas:
                await r.shutdown()

    held, averaged, errors = loop_thread.run(body(), timeout_s=300)
    assert [n for _, n in held] == [2 * B, B, 0]
    want = sum(s for s, _ in held) / (3 * B)
    for got in averaged:
        assert torch.equal(got, averaged[0])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    stranger, wrong_length = errors
    assert isinstance(stranger, InvalidRequest) and "not a member" in str(stranger)
    assert isinstance(wrong_length, InvalidRequest) and "shape" in str(wrong_length)


def test_a_group_naming_a_dead_replica_fails_and_the_next_close_averages_the_living(
    loop_thread, boot
):
    """The close names three replicas, one of which is gone (its server shut down after it was counted): the
    others' all-reduce fails within the part timeout and neither steps on it; the trainer's next close (its
    StageSteps finds the dead one refusing) names the two, and they step together on their samples."""

    async def body():
        replicas = await averaging_replicas(
            3, RUN_ID + "-dead", boot, all_reduce="direct", chunk_timeout_s=1.0
        )
        living, dead = replicas[:2], replicas[2]
        clients = ClientPool()
        try:
            await one_microbatch(living[0], seed=0)
            await one_microbatch(living[1], seed=1)
            held = [await _sums(r) for r in living]
            # (a direct replica writes its progress record at most every DIRECT_PROGRESS_REFRESH_S:
            # tests/test_progress_reports.py)
            assert all(
                r.executor.optimizer.opt.tracker.should_report_progress.interval_s
                == DIRECT_PROGRESS_REFRESH_S
                for r in replicas
            )
            records = {r.peer_id: live_record(r) for r in replicas}
            group = sorted((r.address for r in replicas), key=lambda a: a.peer_id)
            await dead.shutdown()
            for r in living:
                await clients.get(r.address).close_batch(
                    RUN_ID + "-dead", 1, 0, 3, timeout_s=30, group=group
                )
            failed = []
            for r in living:
                opt = r.executor.optimizer
                await until_step_or_failed(opt)
                failed.append((opt.step, opt.retry_round(0) > 0))
            steps = StageSteps([{}, records], clients, RUN_ID + "-dead")
            await steps.close_batch([None, 0], wait_for_step_s=20.0)
            for r in living:
                await until_step(r, 1, "the living replicas stepped on the second group")
            await assert_one_state(living)
            return held, failed, [await _averaged(r) for r in living]
        finally:
            await clients.close()
            for r in living:
                await r.shutdown()

    held, failed, averaged = loop_thread.run(body(), timeout_s=300)
    assert failed == [(0, True), (0, True)]  # the first group failed and nobody stepped on it
    want = sum(s for s, _ in held) / (2 * B)
    for got in averaged:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


async def until_step_or_failed(opt, timeout_s: float = 30.0) -> None:
    """Wait until the replica's direct all-reduce of its step has failed (or it stepped)."""
    from livepeers import until

    await until(lambda: opt.retry_round(0) > 0 or opt.step > 0, "the all-reduce ended", timeout_s)


def test_a_newer_group_replaces_one_stuck_on_a_frozen_replica_without_waiting_out_its_timeout(
    loop_thread, boot
):
    """The close names three replicas; one is frozen (its compute thread held: it never adds its share, though its
    server takes theirs), so the group's all-reduce cannot complete. The trainer's next close names the other
    two: they leave the stuck group at once (its part timeout is a minute) and step together; the thawed replica
    finds them a step ahead and loads their state."""

    async def body():
        run_id = RUN_ID + "-frozen"
        replicas = await averaging_replicas(
            3, run_id, boot, all_reduce="direct", chunk_timeout_s=60.0
        )
        living, frozen = replicas[:2], replicas[2]
        gate = threading.Event()
        clients = ClientPool()
        try:
            for seed, r in enumerate(replicas):
                await one_microbatch(r, seed=seed)
            held = [await _sums(r) for r in living]
            frozen._worker.submit(gate.wait)
            everyone = sorted((r.address for r in replicas), key=lambda a: a.peer_id)
            two = sorted((r.address for r in living), key=lambda a: a.peer_id)
            for group in (everyone, two):
                for r in replicas:
                    await clients.get(r.address).close_batch(
                        run_id, 1, 0, len(group), timeout_s=30, group=group
                    )
            for r in living:
                await until_step(r, 1, "the two stepped on the newer group", timeout_s=30)
            await assert_one_state(living)
            averaged = [await _averaged(r) for r in living]
            gate.set()
            await until_step(frozen, 1, "the thawed replica loaded its peers' state")
            await assert_one_state(replicas)
            return held, averaged
        finally:
            gate.set()
            await clients.close()
            for r in replicas:
                await r.shutdown()

    held, averaged = loop_thread.run(body(), timeout_s=300)
    want = sum(s for s, _ in held) / (2 * B)
    for got in averaged:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_group_that_failed_on_a_moment_of_silence_runs_again_in_a_new_round(loop_thread, boot):
    """Two replicas hold a microbatch each; one is frozen a moment (its compute thread held) when the close names
    them both, longer than the part timeout, so the group's all-reduce fails at both, though both live and answer
    the trainer. A member does not run a group that failed again; its close reply says which round to try next,
    and the trainer's next close names the same two in that round: they run it at once and step together on both
    samples, rather than each wait out averaging_timeout_s (60 s here) and step alone on its own."""

    async def body():
        run_id = RUN_ID + "-round"
        replicas = await averaging_replicas(
            2, run_id, boot, all_reduce="direct", chunk_timeout_s=1.0, averaging_timeout_s=60.0
        )
        silent = replicas[1]
        gate = threading.Event()
        clients = ClientPool()
        try:
            for seed, r in enumerate(replicas):
                await one_microbatch(r, seed=seed)
            held = [await _sums(r) for r in replicas]
            silent._worker.submit(gate.wait)
            group = sorted((r.address for r in replicas), key=lambda a: a.peer_id)
            for r in replicas:
                await clients.get(r.address).close_batch(run_id, 1, 0, 2, timeout_s=30, group=group)
            await until_step_or_failed(replicas[0].executor.optimizer)
            gate.set()  # thawed, it runs the group too: its groupmate is no longer in it
            await until_step_or_failed(silent.executor.optimizer)
            failed = [(r.executor.step, r.executor.optimizer.retry_round(0)) for r in replicas]

            records = {r.peer_id: live_record(r) for r in replicas}
            steps = StageSteps([{}, records], clients, run_id)
            stepped = await steps.wait_for_stage_steps([0, 1], stall_s=30.0, every_replica=True)
            await assert_one_state(replicas)
            return held, failed, stepped, steps._round(1, 0), [await _averaged(r) for r in replicas]
        finally:
            gate.set()
            await clients.close()
            for r in replicas:
                await r.shutdown()

    held, failed, stepped, round, averaged = loop_thread.run(body(), timeout_s=300)
    assert failed == [(0, 1), (0, 1)]  # round 0 failed at both, and neither stepped
    assert (
        stepped and round == 1
    )  # within stall_s (30 s): before averaging_timeout_s would have them step alone
    # the average of both replicas' samples: stepping alone, each would have loaded its own sums over B
    want = sum(s for s, _ in held) / (2 * B)
    for got in averaged:
        assert torch.equal(got, averaged[0])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("holds_samples", [False, True], ids=["with-nothing", "with-samples"])
def test_a_replica_named_alone_while_its_peer_is_a_step_ahead_takes_its_peers_state(
    loop_thread, boot, holds_samples
):
    """One replica stepped alone on its part of the batch; the other, a step behind, is named alone for that step by
    the trainer's next close (the only replica it found at it). It takes its peer's state at once: the close says how
    far the stage is (stage_step).

    With nothing of the batch, it waited for nothing before, while the trainer closed the step again every two
    seconds (a soak's replica sat there 30 s, and its peer's all-reduce of the next step, which named it, failed).
    Holding samples of it (a frozen replica thawed one step behind, say), it stepped alone on them before: a second
    step 0 of its own, and the stage ran on with two models, the later all-reduces giving both the same average but
    never the same parameters (test_averaging's kill/freeze test on a loaded machine ended with two digests). Its
    samples now join step 1, late, as batch 0's."""

    async def body():
        run_id = f"{RUN_ID}-behind-{holds_samples}"
        ahead, behind = await averaging_replicas(2, run_id, boot, all_reduce="direct")
        clients = ClientPool()
        try:
            await one_microbatch(ahead, seed=0)
            ahead.executor.close_batch(0, replicas=1)  # the trainer found it alone: it steps alone
            await until_step(ahead, 1, "the first replica stepped alone on its part of the batch")
            if holds_samples:
                # the other part, at the replica still at step 0
                await one_microbatch(behind, seed=1)
            records = {r.peer_id: live_record(r) for r in (ahead, behind)}
            steps = StageSteps([{}, records], clients, run_id)
            await steps.close_batch(
                [None, 0]
            )  # names `behind` alone for step 0, the stage at step 1
            told = behind.executor.optimizer._peers_step
            await until_step(behind, 1, "the replica behind took its peer's state", timeout_s=30)
            await assert_one_state([ahead, behind])
            return told, behind.executor.optimizer.opt.grad_averager.carried
        finally:
            await clients.close()
            for r in (ahead, behind):
                await r.shutdown()

    told, carried = loop_thread.run(body(), timeout_s=300)
    assert told == 1
    assert carried == ({0: B} if holds_samples else {})


def test_a_replica_gone_after_a_step_taken_without_it_has_its_part_computed_again_and_applied_late(
    loop_thread, boot
):
    """Three replicas average batch 0 together. The trainer's close of batch 1 names two of them (the third did not
    answer in time: in bench/soak.py, killed while the close asked its step), and they step on it without the
    third's microbatch; then the third is gone. At the trainer's next close, the live replicas' Info says whose
    gradients their steps averaged: what the gone replica held of batch 1, left out of that step, is computed
    again at a live replica and goes into the stage's next step, late, as a sample of batch 1; what it held of
    batch 0, whose step it took part in, is not computed again (it would count twice)."""

    async def body():
        run_id = RUN_ID + "-left-out"
        replicas = await averaging_replicas(3, run_id, boot, all_reduce="direct")
        a, b, c = replicas
        clients = ClientPool()
        try:
            for seed, r in enumerate(replicas):
                await one_microbatch(r, seed=seed, batch_step=0)
            records = {r.peer_id: live_record(r) for r in replicas}
            await StageSteps([{}, records], clients, run_id).close_batch(
                [None, 0], wait_for_step_s=20.0
            )
            for r in replicas:
                await until_step(r, 1, "the three stepped on batch 0 together")
            for seed, r in enumerate(replicas, start=3):
                await one_microbatch(r, seed=seed, batch_step=1)
            two = {r.peer_id: live_record(r) for r in (a, b)}
            await StageSteps([{}, two], clients, run_id).close_batch(
                [None, 1], wait_for_step_s=20.0
            )
            for r in (a, b):
                await until_step(r, 2, "the two stepped on batch 1 without the third")
            await c.shutdown()

            # A trainer holding what c counted of batches 0 and 1; its redo computes again at a.
            holdings = Holdings(num_stages=2)
            holdings.enabled = True
            redone: list[str] = []

            def redo(microbatch_id: str, seed: int):
                async def run() -> str:
                    redone.append(microbatch_id)
                    await one_microbatch(a, seed=seed, batch_step=1)
                    return a.peer_id

                return run

            holdings.add(1, 0, c.peer_id, "c-batch-0", redo("c-batch-0", 2))
            holdings.add(1, 1, c.peer_id, "c-batch-1", redo("c-batch-1", 5))
            await StageSteps([{}, records], clients, run_id, holdings=holdings).close_batch(
                [None, 2]
            )
            told = (await clients.get(a.address).info(run_id, timeout_s=10)).averaged_steps
            late = await a._worker.compute_urgent(
                lambda: dict(a.executor.optimizer.opt.grad_averager.carried)
            )
            held_a = await _sums(a)
            # the stage's next step (a and b) takes it in
            await StageSteps([{}, two], clients, run_id).close_batch(
                [None, 2], wait_for_step_s=20.0
            )
            for r in (a, b):
                await until_step(r, 3, "the two stepped on batch 2 with the late microbatch")
            await assert_one_state([a, b])
            return (
                [(s.step, sorted(s.members)) for s in told],
                redone,
                holdings.redone,
                late,
                held_a,
                [await _averaged(r) for r in (a, b)],
                sorted(r.peer_id for r in replicas),
                sorted(r.peer_id for r in (a, b)),
            )
        finally:
            await clients.close()
            for r in replicas:
                await r.shutdown()

    told, redone, count, late, held_a, averaged, three, two = loop_thread.run(body(), timeout_s=300)
    assert told == [(0, three), (1, two)]
    assert redone == ["c-batch-1"] and count == 1
    assert late == {1: B}
    sums, samples = held_a
    assert samples == B  # (the late one: a holds nothing else of batch 2)
    for got in averaged:  # b put in nothing: the step averaged the late microbatch alone
        torch.testing.assert_close(got, sums / B, rtol=1e-5, atol=1e-7)
