"""swarm's relay (swarm.transport.relay, swarm.transport.relaylink) on loopback: real TCP, real peers, real gRPC+TLS.

A relay lends an endpoint to an authenticated peer, splices callers into it through an outbound data connection,
and carries gRPC with TLS end to end (the caller pins the relayed peer's certificate; pinning another fails). Bad
input is bounded and answered: a bad token, an unknown nonce, junk, silence, a flood of idle connections, a caller
of a peer that is gone or does not answer. Hosts behind real NAT routers are in tests/test_netns_relay.py (root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest

from swarm.deadline import timeout
from swarm.discovery.records import RecordError, StageRecord
from swarm.errors import SwarmError
from swarm.identity import Identity
from swarm.states import Reachability
from swarm.transport.callers import CallerCheck, CallerToken
from swarm.transport.client import PeerClient
from swarm.transport.relay import (
    RelayError,
    RelayServer,
    read_message,
    token_message,
    write_message,
)
from swarm.transport.relayconfig import RelayConfig
from swarm.transport.relaylink import RelayLink
from swarm.transport.security import PeerAddress
from tests.conftest import record_wire

pytestmark = pytest.mark.integration

OPEN_S = 1.0  # the relays' open timeout in these tests: a caller nobody opens for is cut after it
# the live peers' heartbeat and record lifetime: long enough that a loaded machine does not expire a record
TIMING = dict(heartbeat_s=1.0, ttl_s=10.0)
PAYLOAD = os.urandom(
    4 << 20
)  # 4 MiB: far past the 128 KiB that p2pd's circuit relays carry (docs/nat.md)


def test_config_and_record_fields_are_checked():
    with pytest.raises(ValueError, match=r"relay_max_peers \(0\).*--no-relay-for-others"):
        RelayConfig(relay_max_peers=0)
    with pytest.raises(ValueError, match="relay_keepalive_s and relay_open_timeout_s"):
        RelayConfig(relay_keepalive_s=0)
    relayed = StageRecord.from_wire(
        record_wire(reachability="relayed", relay_peer_id="0123456789abcdef")
    )
    assert relayed.callable and relayed.reachability == Reachability.RELAYED
    assert not StageRecord.from_wire(record_wire(reachability="relayed")).callable
    assert StageRecord.from_wire(
        record_wire()
    ).callable  # direct, and an older record without the fields
    with pytest.raises(RecordError, match="relay_peer_id must be a peer id"):
        StageRecord.from_wire(record_wire(relay_peer_id="not-a-peer"))
    with pytest.raises(RecordError, match="out-of-range"):
        StageRecord.from_wire(record_wire(relay_port=70000))


@contextlib.asynccontextmanager
async def _relay(**config):
    identity = Identity.ephemeral()
    server = RelayServer(
        RelayConfig(relay_open_timeout_s=OPEN_S, relay_keepalive_s=1.0, **config),
        authenticate=CallerCheck(identity.peer_id).caller,
        public_host="127.0.0.1",
    )
    await server.start()
    try:
        yield server, identity.peer_id
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def _echo():
    """A local TCP server echoing what it reads: the relayed peer's own server in the byte-level tests."""

    async def echo(reader, writer):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def _link(relay: RelayServer, relay_id: str, local_port: int, identity=None) -> RelayLink:
    return RelayLink(
        relay_host="127.0.0.1",
        relay_port=relay.port,
        relay_peer_id=relay_id,
        token=CallerToken(identity or Identity.ephemeral()),
        local_host="127.0.0.1",
        local_port=local_port,
        timeout_s=5.0,
    )


async def _echo_through(endpoint: str, payload: bytes) -> bytes:
    host, port = endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    await writer.drain()
    got = await reader.readexactly(len(payload))
    writer.close()
    return got


async def _closed_within(endpoint: str, bound_s: float) -> float:
    """Seconds until a connection to ``endpoint`` is refused or closed by the far end (within ``bound_s``)."""
    host, port = endpoint.rsplit(":", 1)
    start = time.monotonic()
    try:
        async with timeout(bound_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            assert await reader.read() == b""
            writer.close()
    except ConnectionRefusedError:
        pass
    return time.monotonic() - start


def test_splice_carries_megabytes_both_ways_and_counts_them():
    asyncio.run(_splice_carries_megabytes_both_ways_and_counts_them())


async def _splice_carries_megabytes_both_ways_and_counts_them():
    async with _relay() as (relay, relay_id), _echo() as local_port:
        peer = Identity.ephemeral()
        link = _link(relay, relay_id, local_port, peer)
        endpoint = await link.open()
        serving = asyncio.ensure_future(link.serve())
        assert relay.tenants == {peer.peer_id: endpoint}
        got = await asyncio.gather(*(_echo_through(endpoint, PAYLOAD) for _ in range(3)))
        assert all(g == PAYLOAD for g in got)
        assert relay.stats.connections == 3 and link.connections == 3
        assert relay.stats.relayed_bytes >= 2 * 3 * len(PAYLOAD)
        # The relayed peer goes (its control channel closes): its port closes, a caller is refused at once.
        await link.close()
        assert "lost" in await serving
        await _wait_for(lambda: not relay.tenants)
        assert await _closed_within(endpoint, bound_s=5.0) < OPEN_S


async def _wait_for(condition, bound_s: float = 10.0) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)  # poll


def test_bad_input_is_refused_and_bounded():
    asyncio.run(_bad_input_is_refused_and_bounded())


async def _bad_input_is_refused_and_bounded():
    async with (
        _relay(relay_max_connections=4, relay_max_peers=1) as (relay, relay_id),
        _echo() as port,
    ):

        async def first_line(message) -> tuple[dict | None, bytes]:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(message if isinstance(message, bytes) else b"")
            if isinstance(message, dict):
                write_message(writer, message)
            await writer.drain()
            try:
                reply = await read_message(reader, timeout_s=5.0)
            except RelayError:
                reply = None
            rest = await asyncio.wait_for(reader.read(), 5.0)
            writer.close()
            return reply, rest

        # a token made for another peer, a forged one, none: refused with the reason, and closed
        other = CallerToken(Identity.ephemeral())
        reply, _ = await first_line(token_message(other.metadata("0123456789abcdef")))
        assert (
            reply == {"ok": False, "error": reply["error"]}
            and "good at one peer only" in reply["error"]
        )
        forged = token_message(other.metadata(relay_id)) | {"sig": "AAAA"}
        assert "signature" in (await first_line(forged))[0]["error"]
        assert "no caller token" in (await first_line({"op": "control"}))[0]["error"]
        # an unknown nonce, junk, an unknown op: closed without a byte relayed
        assert await first_line({"op": "data", "nonce": "00" * 16}) == (None, b"")
        assert await first_line(b"GET / HTTP/1.1\r\n\r\n") == (None, b"")
        assert (await first_line({"op": "shell"}))[0]["ok"] is False
        assert await first_line(b"x" * 20000) == (None, b"")  # a line past the limit
        assert relay.stats.refused["unauthenticated"] == 3

        # One peer at most (--relay-max-peers 1): a second is told to pick another relay.
        link = _link(relay, relay_id, port)
        endpoint = await link.open()
        serving = asyncio.ensure_future(link.serve())
        with pytest.raises(RelayError, match="relay-max-peers"):
            await _link(relay, relay_id, port).open()

        # A flood of idle connections holds at most 4 handshakes (each new one closes the oldest), and each idle
        # one is closed after the open timeout. The relayed peer's callers are served throughout.
        flood = [await asyncio.open_connection("127.0.0.1", relay.port) for _ in range(40)]
        assert await _echo_through(endpoint, PAYLOAD[:65536]) == PAYLOAD[:65536]
        closed = await asyncio.gather(*(asyncio.wait_for(r.read(), 5 * OPEN_S) for r, _ in flood))
        assert closed == [b""] * 40
        assert relay.stats.refused["handshakes"] >= 40 - 4
        for _, w in flood:
            w.close()
        await link.close()
        await serving


def test_a_peer_that_opens_nothing_costs_its_caller_one_open_timeout():
    asyncio.run(_a_peer_that_opens_nothing_costs_its_caller_one_open_timeout())


async def _a_peer_that_opens_nothing_costs_its_caller_one_open_timeout():
    async with _relay() as (relay, relay_id):
        # a "peer" that holds its control channel (answering keepalives would not matter) and never opens
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        write_message(writer, token_message(CallerToken(Identity.ephemeral()).metadata(relay_id)))
        endpoint = (await read_message(reader, timeout_s=5.0))["endpoint"]
        took = await _closed_within(endpoint, bound_s=5 * OPEN_S)
        assert OPEN_S * 0.9 <= took < 4 * OPEN_S
        assert relay.stats.refused["not opened"] == 1
        # silent for 3 keepalives (no pings): the relay drops the channel and the port
        await _wait_for(lambda: not relay.tenants, bound_s=10.0)
        writer.close()


def test_a_relayed_peer_serves_grpc_with_tls_through_a_relay_and_moves_when_it_dies(
    peers, loop_thread
):
    """Two reachable peers relay; a peer serving at 127.0.0.2 (its calls leave from 127.0.0.1, so the dial-back
    finds it unreachable, as behind NAT) takes an endpoint on one of them and announces it. Callers pin its own
    certificate through the splice; when its relay stops it moves to the other; once it is gone, a caller of its
    last endpoint fails at once."""
    relays = {
        p.peer_id: p
        for p in (
            peers("relay", 1, relay=RelayConfig(relay_open_timeout_s=OPEN_S)) for _ in range(2)
        )
    }
    hidden = peers("relay", 0, host="127.0.0.2", **TIMING)
    assert hidden.reachability == Reachability.RELAYED and hidden.relay_server is None
    assert all(p.relay_server is not None for p in relays.values())

    def record_where(condition, bound_s: float = 60.0) -> StageRecord:
        """The relayed peer's record once it meets ``condition`` (polling the DHT, within ``bound_s``)."""
        deadline = time.monotonic() + bound_s
        while True:
            found = loop_thread.run(hidden.directory.stage_records(0)).get(hidden.peer_id)
            if found is not None and condition(found):
                return found
            assert time.monotonic() < deadline, found
            time.sleep(0.2)  # polling the DHT: the announcement is an event in another view

    first = record_where(lambda r: r.relay_peer_id in relays)
    assert first.callable and first.reachability == Reachability.RELAYED
    relay = relays[first.relay_peer_id]
    assert relay.relay_server.tenants == {hidden.peer_id: first.endpoint}
    relay_port = loop_thread.run(relay.directory.stage_records(1))[relay.peer_id].relay_port
    assert relay_port == relay.relay_server.port

    async def calls(address: PeerAddress, impostor: PeerAddress | None = None):
        pinned = PeerClient(address)
        try:
            info = await pinned.info("relay", timeout_s=10)
            state = await pinned.get_state("relay", timeout_s=10)
            if impostor is not None:  # the relay's own key does not answer at the endpoint it lent
                with pytest.raises(SwarmError):
                    await PeerClient(impostor).info("relay", timeout_s=3)
            return info.peer_id, sum(t.numel() for t in state.tensors.values())
        finally:
            await pinned.close()

    impostor = PeerAddress(first.endpoint, relay.peer_id, relay.tls_cert)
    peer_id, numel = loop_thread.run(calls(PeerAddress.of(first), impostor))
    assert peer_id == hidden.peer_id and numel > 0
    assert (
        relay.relay_server.stats.relayed_bytes > 4 * numel
    )  # the state's fp32 bytes crossed the splice

    # Its relay leaves: it re-announces through the other one, and serves there.
    loop_thread.run(relay.shutdown())
    moved = record_where(lambda r: r.relay_peer_id not in ("", relay.peer_id))
    assert loop_thread.run(calls(PeerAddress.of(moved)))[0] == hidden.peer_id

    # It goes: its relay closes the lent port, so a caller still holding the record fails at once.
    loop_thread.run(hidden.shutdown())

    async def stale_call():
        client = PeerClient(PeerAddress.of(moved))
        start = time.monotonic()
        try:
            with pytest.raises(SwarmError) as failed:
                await client.info("relay", timeout_s=30)
            return failed.value, time.monotonic() - start
        finally:
            await client.close()

    failed, took = loop_thread.run(stale_call())
    assert failed.retry_elsewhere and took < 10, (failed, took)


def test_a_relayed_replica_that_loses_its_relay_leaves_out_what_it_holds(peers, loop_thread):
    """A relay closes the port it lent once its tenant is gone or silent past its keepalives (frozen, say); a trainer
    closing a batch meanwhile finds the port refusing, takes the replica for gone and computes its samples of the
    unstepped batches again elsewhere (swarm.trainer.stagesteps). So a relayed averaging replica that finds its relay
    lost leaves out every sample it holds for a step not yet taken, this batch's and those kept for a later one,
    and counts them: carried on, they would count twice."""
    from livepeers import CLOSE_DRIVEN_RUN, B, one_microbatch, until

    from swarm.averaging.config import AveragingConfig

    relay = peers(
        "relaylost", 0, run=CLOSE_DRIVEN_RUN, relay=RelayConfig(relay_open_timeout_s=OPEN_S)
    )
    hidden = peers(
        "relaylost",
        1,
        run=CLOSE_DRIVEN_RUN,
        host="127.0.0.2",
        averaging=AveragingConfig(average=True),
        **TIMING,
    )
    assert hidden.reachability == Reachability.RELAYED
    optimizer = hidden.executor.optimizer

    async def body():
        await until(lambda: hidden.relaying.link is not None, "it serves through the relay")
        await one_microbatch(hidden, 0)  # batch 0, which no close ends here
        await one_microbatch(hidden, 1, batch_step=1)  # kept aside for the next step
        assert optimizer.local_samples == B and optimizer.samples_left_out == 0
        await relay.shutdown()
        await until(lambda: optimizer.samples_left_out == 2 * B, "it leaves its samples out")
        assert optimizer.local_samples == 0 and optimizer.step == 0
        assert hidden.executor.samples_left_out == 2 * B

    loop_thread.run(body(), timeout_s=120)


def test_a_relayed_replica_thawed_before_it_hears_of_its_relay_holds_its_step(
    peers, loop_thread, caplog
):
    """The race left by the test above: a relayed replica frozen past its relay's keepalives (the relay closes the
    port it lent; a trainer then takes the replica for gone and computes its samples again elsewhere) thaws with the
    lost channel's news still unread. Its step check must not step on (or hand over) what it holds before its
    relaying loop tells: it waits while the relay has not been heard for two keepalives. The freeze is the whole
    event loop's (relay and replica share it here), held past three keepalives with the batch closed; the compute
    thread runs the step check before the loop resumes, as on a thaw. And once the loop finds the relay lost, a step
    check that runs before the replica has seen to its samples (one CI run stepped on them there: the link was
    dropped, so no longer in doubt, before the samples were left out) still waits."""
    import logging

    from livepeers import CLOSE_DRIVEN_RUN, B, one_microbatch, until

    from swarm.averaging.config import AveragingConfig

    caplog.set_level(logging.WARNING, logger="swarm.averaging.optimizer")
    keepalive_s = 1.0
    peers(  # the relay
        "relaythaw",
        0,
        run=CLOSE_DRIVEN_RUN,
        relay=RelayConfig(relay_open_timeout_s=OPEN_S, relay_keepalive_s=keepalive_s),
    )
    hidden = peers(
        "relaythaw",
        1,
        run=CLOSE_DRIVEN_RUN,
        host="127.0.0.2",
        averaging=AveragingConfig(average=True),
        **TIMING,
    )
    assert hidden.reachability == Reachability.RELAYED
    optimizer = hidden.executor.optimizer
    told = hidden.relaying._on_change
    checks_while_told = []

    async def on_change(endpoint: str, relay_peer_id: str) -> None:
        if not endpoint:  # lost: a step check lands before the replica has seen to its samples
            checks_while_told.append(
                await hidden._worker.compute_urgent(hidden.executor.maybe_step)
            )
        await told(endpoint, relay_peer_id)

    hidden.relaying._on_change = on_change

    async def body():
        await until(lambda: hidden.relaying.link is not None, "it serves through the relay")
        # Heard from: it steps through the relay as any replica (it is the stage's only one).
        await one_microbatch(hidden, 0)
        hidden.executor.close_batch(0, replicas=1)
        await until(lambda: optimizer.step == 1, "it steps on batch 0")
        assert optimizer.samples_left_out == 0
        await one_microbatch(hidden, 1, batch_step=1)
        assert optimizer.local_samples == B
        # Frozen: nothing on the event loop runs, the relay's keepalives included.
        time.sleep(4 * keepalive_s)
        hidden.executor.close_batch(1, replicas=1)
        # Thawed: the compute thread checks the step before the event loop reads the lost channel.
        stepped = hidden._worker.submit(hidden.executor.maybe_step).result(timeout=30)
        assert not stepped and optimizer.step == 1 and optimizer.local_samples == B
        # The loop resumes: the relay drops the silent tenant, the replica hears of it and leaves its samples out.
        await until(lambda: optimizer.samples_left_out == B, "it leaves its samples out")
        assert optimizer.local_samples == 0 and optimizer.step == 1
        assert checks_while_told == [False]

    loop_thread.run(body(), timeout_s=120)
    assert any("step 1 waits for word" in m for m in caplog.messages), caplog.messages
