"""The trainer's half of exactly-once commits (swarm.trainer.commits): when the commit at the end of a call is
not confirmed, ask again through the Commit RPC until the peer answers or its hold is surely over."""

from __future__ import annotations

import asyncio
import functools
import time

import grpc
import pytest
from livepeers import closed_port

import swarm.trainer.commits as commits
from swarm.errors import GradientsDropped, TransportError
from swarm.proto import swarm_pb2 as pb
from swarm.trainer.commits import COMMIT_TIMEOUT_S, Outcome, asked_where_it_is, commit_outcome
from swarm.transport.client import PeerClient, Reply


def reply_with(confirmation, answers: list, *, hold_s: float = 5.0) -> tuple[Reply, list]:
    """A gradient call's reply whose in-call commit ends with ``confirmation`` (None: confirmed, an exception:
    raised, "hang": never resolves) and whose Commit RPC gives ``answers`` in turn (an exception is raised);
    returns it and the list of the RPC's timeouts, one per call."""
    loop = asyncio.get_running_loop()
    committed = loop.create_future()
    if confirmation is None:
        committed.set_result(None)
    elif confirmation != "hang":
        committed.set_exception(confirmation)
    calls: list[float] = []

    async def commit_again(timeout_s: float) -> bool:
        calls.append(timeout_s)
        answer = answers[min(len(calls), len(answers)) - 1]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    reply = Reply(
        pb.ReplyMeta(commit_hold_s=hold_s),
        {},
        committed=committed,
        commit_again=commit_again,
        hold_until=time.monotonic() + hold_s,
    )
    return reply, calls


@pytest.fixture
def quick(monkeypatch):
    """Retry every 10 ms and stop 50 ms after the hold, so the tests take well under a second."""
    monkeypatch.setattr(commits, "RETRY_EVERY_S", 0.01)
    monkeypatch.setattr(commits, "AFTER_HOLD_S", 0.05)


def outcome(confirmation, answers, **kw):
    async def go():
        reply, calls = reply_with(confirmation, answers, **kw)
        return await commit_outcome(reply), calls

    return asyncio.run(go())


def test_a_confirmed_commit_asks_nothing_more():
    assert outcome(None, []) == (Outcome.APPLIED, [])


def test_a_refused_commit_is_dropped_at_once():
    got, calls = outcome(GradientsDropped("hold over"), [])
    assert (got, calls) == (Outcome.DROPPED, [])


@pytest.mark.parametrize(
    "answer", [True, False]
)  # applied now, or by the in-call commit that was not confirmed
def test_a_lost_confirmation_is_asked_again_and_counts_once(answer):
    got, calls = outcome(TransportError("stream reset"), [answer])
    assert (got, len(calls)) == (Outcome.APPLIED, 1)


def test_a_peer_unreachable_for_a_while_is_asked_until_it_answers(quick):
    got, calls = outcome(
        TransportError("reset"), [TransportError("down")] * 3 + [GradientsDropped("x")]
    )
    assert (got, len(calls)) == (Outcome.DROPPED, 4)


def test_a_peer_silent_past_its_hold_leaves_the_outcome_unknown_and_is_not_asked_forever(quick):
    t0 = time.monotonic()
    got, calls = outcome("hang", [TransportError("frozen")], hold_s=0.1)
    took = time.monotonic() - t0
    assert got is Outcome.UNKNOWN
    # It waited for the in-call confirmation through the hold, then asked until past it: never giving up
    # before the peer's hold is over (only then can it no longer count the gradient), and stopping after.
    assert 0.1 + 0.05 <= took and len(calls) >= 1


def test_a_gradient_no_peer_counts_is_computed_again_a_bounded_number_of_times(quick):
    """Pipeline._settle against replies whose commits are always dropped (a hold shorter than the transfer):
    it computes the gradient again MAX_RECOMPUTES times, then ends the microbatch with a sentence."""
    import types

    from swarm.errors import SwarmError
    from swarm.trainer.pipeline import MAX_RECOMPUTES, Pipeline

    counters = types.SimpleNamespace(
        unconfirmed_commits=0, recomputed_gradients=0, records=[{}, {}], clients=None
    )
    counters._asked_where_it_is = functools.partial(Pipeline._asked_where_it_is, counters)
    computed = []

    async def go():
        async def recompute():
            computed.append(1)
            return reply_with(GradientsDropped("hold over"), [])[0], f"peer-{len(computed)}"

        first = reply_with(TransportError("frozen"), [TransportError("frozen")], hold_s=0.05)[0]
        await Pipeline._settle(counters, "mb", 1, first, "peer-0", recompute)

    with pytest.raises(
        SwarmError, match=rf"computed {MAX_RECOMPUTES + 1} times; is the peers' --commit-hold-s"
    ):
        asyncio.run(go())
    assert len(computed) == counters.recomputed_gradients == MAX_RECOMPUTES
    assert (
        counters.unconfirmed_commits == 1
    )  # the first peer never answered; the others said "dropped"


def test_a_commit_is_asked_again_where_the_peer_serves_now(quick):
    """A relayed peer's relay died with the confirmation of its reply: the peer serves at another relay's endpoint
    and still holds the gradient there. The Commit RPC follows its newest record (None until the trainer reads
    it: asked where the call went), so the gradient counts once and nothing is computed again."""
    asked_at_new: list[tuple] = []

    class AtTheNewEndpoint:
        async def commit(self, *args) -> bool:
            asked_at_new.append(args)
            return True

    records: list = [None, None, AtTheNewEndpoint()]  # what the trainer's records name at each ask

    async def go():
        reply, asked_at_old = reply_with(TransportError("relay gone"), [TransportError("refused")])
        reply.commit_key = ("run", 1, "mb-7", 3)
        got = await commit_outcome(asked_where_it_is(reply, lambda: records.pop(0)))
        return got, asked_at_old

    got, asked_at_old = asyncio.run(go())
    assert got is Outcome.APPLIED
    assert len(asked_at_old) == 2 and asked_at_new == [("run", 1, "mb-7", 3, COMMIT_TIMEOUT_S)]


def test_a_reply_without_a_commit_is_left_as_it_is():
    reply = Reply(pb.ReplyMeta(), {})
    assert asked_where_it_is(reply, lambda: pytest.fail("asked for a client")) is reply
    assert reply.commit_again is None


def unavailable(text: str) -> TransportError:
    """The error a Commit RPC ends with when the peer's connection is refused or its channel broke."""
    error = TransportError(text)
    error.status = grpc.StatusCode.UNAVAILABLE
    return error


def test_a_peer_whose_address_refuses_connections_is_not_asked_through_its_hold():
    """Killed between its reply and the commit: nothing listens at its address, so it can count nothing more and the
    rest of its hold would tell nothing. The outcome is unknown at once (the soak's kill mid-commit held its batch
    ~13 s waiting out the hold)."""
    probes: list[bool] = []

    async def go():
        reply, calls = reply_with(TransportError("reset"), [unavailable("refused")], hold_s=30.0)

        async def gone() -> bool:
            probes.append(True)
            return True

        reply.gone = gone
        got = await commit_outcome(reply)
        return got, calls, time.monotonic() < reply.hold_until

    got, calls, within_hold = asyncio.run(go())
    assert (got, len(calls), probes, within_hold) == (Outcome.UNKNOWN, 1, [True], True)


def test_a_peer_whose_port_still_accepts_connections_is_asked_until_it_answers(quick):
    """Frozen (its port open: the kernel accepts for it), or busy: asked on, its address probed after each
    UNAVAILABLE, until it answers."""
    probes: list[bool] = []

    async def go():
        answers = [unavailable("keepalive"), unavailable("keepalive"), True]
        reply, calls = reply_with(TransportError("reset"), answers, hold_s=30.0)

        async def gone() -> bool:
            probes.append(False)
            return False

        reply.gone = gone
        return await commit_outcome(reply), calls

    got, calls = asyncio.run(go())
    assert (got, len(calls), len(probes)) == (Outcome.APPLIED, 3, 2)


def test_a_commit_to_a_real_closed_port_ends_unknown_at_once():
    """Through a real client and a real port nothing listens at (where a killed peer served): the Commit RPC fails
    UNAVAILABLE, the probe finds the port refusing, and the outcome is unknown long before the hold's end."""

    async def go():
        client = PeerClient(f"127.0.0.1:{closed_port()}")
        try:
            reply, _ = reply_with(TransportError("reset"), [], hold_s=30.0)
            reply.commit_key = ("run", 1, "mb-9", 2)
            reply.commit_again = functools.partial(client.commit, *reply.commit_key)
            reply.endpoint = client.endpoint
            got = await commit_outcome(asked_where_it_is(reply, lambda: None))
            return got, time.monotonic() < reply.hold_until
        finally:
            await client.close()

    assert asyncio.run(go()) == (Outcome.UNKNOWN, True)


def test_a_relayed_peer_whose_relay_refuses_is_asked_on_until_its_new_address_answers(quick):
    """Its relay died (the address refuses) but the peer lives on behind another relay, holding the gradient: its
    record names a relay's address, so the refusal is not taken for its end; asked on, it answers there."""

    async def go():
        reply, calls = reply_with(
            TransportError("relay gone"),
            [unavailable("refused"), unavailable("refused"), True],
            hold_s=30.0,
        )
        reply.commit_key = ("run", 1, "mb-3", 2)
        reply.endpoint = (
            f"127.0.0.1:{closed_port()}"  # the dead relay's port: a probe would find it refusing
        )
        asked = asked_where_it_is(reply, lambda: None, own_address=lambda: False)
        return await commit_outcome(asked), calls

    got, calls = asyncio.run(go())
    assert (got, len(calls)) == (Outcome.APPLIED, 3)
