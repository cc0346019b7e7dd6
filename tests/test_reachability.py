"""The reachability check at a peer's start (swarm.peer.reachability): real peers, real DHT, real gRPC on loopback.

A peer of a run that already has a serving peer asks it to dial back, and announces the answer in its signed record;
the answering peer dials only the address the call came from, pins the caller's certificate, and answers bad input
with a clear status. Hosts behind a real NAT are in tests/test_netns_reachability.py (root).
"""

from __future__ import annotations

import socket

import pytest

from swarm.discovery.records import RecordError, StageRecord
from swarm.errors import InvalidRequest, WrongPeer
from swarm.peer.config import LimitsConfig
from swarm.states import PeerState, Reachability
from swarm.transport.client import PeerClient

pytestmark = pytest.mark.integration

DIAL_S = 1.5  # the answering peer's dial bound: a dial to nothing fails after it


def _record_fields(**kw) -> dict:
    fields = dict(
        peer_id="p",
        endpoint="127.0.0.1:1",
        stage=0,
        state="serving",
        throughput=1.0,
        in_flight=0,
        step=0,
        config_hash="h",
    )
    return {**fields, **kw}


def test_records_without_reachability_read_as_direct():
    assert StageRecord.from_wire(_record_fields()).reachability == Reachability.DIRECT
    relayed = StageRecord.from_wire(_record_fields(reachability="relayed"))
    assert relayed.reachability == Reachability.RELAYED
    assert relayed.to_wire()["reachability"] == "relayed"
    with pytest.raises(RecordError, match="reachability"):
        StageRecord.from_wire(_record_fields(reachability="teleported"))


def test_dial_back_timeout_must_be_bounded():
    with pytest.raises(ValueError, match=r"dial_back_timeout_s must be in \(0, 60\], got 0"):
        LimitsConfig(dial_back_timeout_s=0)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, never listening, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_joining_peer_is_dialed_back_and_announced_direct(peers, loop_thread):
    first = peers("reach", 1, limits=LimitsConfig(dial_back_timeout_s=DIAL_S))
    # the run's first peer has nobody to ask: direct, unchecked, and it says so
    assert first.reachability_verdict.asked == ""
    assert "no other serving peer" in first.reachability_verdict.detail
    second = peers("reach", 0)
    verdict = second.reachability_verdict
    assert (verdict.reachability, verdict.asked) == (Reachability.DIRECT, first.peer_id)
    assert verdict.observed_host == "127.0.0.1"
    records = loop_thread.run(second.directory.stage_records(0))
    assert records[second.peer_id].reachability == Reachability.DIRECT

    async def ask(endpoint: str, tls_cert: str, run_id: str = "reach"):
        client = PeerClient(first.address)
        try:
            return await client.dial_back(run_id, endpoint, tls_cert, timeout_s=DIAL_S + 10)
        finally:
            await client.close()

    # Another host than the call's source: answered without a dial, naming the source.
    reply = loop_thread.run(ask(f"127.0.0.2:{_closed_port()}", second.tls_cert))
    assert not reply.reachable and reply.observed_host == "127.0.0.1"
    assert "came from 127.0.0.1" in reply.detail and "Not dialed" in reply.detail
    # The caller's own address, but nothing listens there: the dial fails within its bound.
    reply = loop_thread.run(ask(f"127.0.0.1:{_closed_port()}", second.tls_cert))
    assert not reply.reachable and f"within {DIAL_S:g}s" in reply.detail
    # A server is there, but it holds another key than the certificate pinned: not the caller's endpoint.
    reply = loop_thread.run(ask(second.endpoint, first.tls_cert))
    assert not reply.reachable and "another key" in reply.detail
    assert loop_thread.run(ask(second.endpoint, second.tls_cert)).reachable
    # Bad input: a clear status, nothing dialed.
    with pytest.raises(InvalidRequest, match="host:port"):
        loop_thread.run(ask("no-port-here", ""))
    with pytest.raises(InvalidRequest, match="not a PEM certificate"):
        loop_thread.run(ask(second.endpoint, "garbage"))
    with pytest.raises(WrongPeer, match="not 'other'"):
        loop_thread.run(ask(second.endpoint, second.tls_cert, run_id="other"))


def test_a_peer_whose_endpoint_nobody_can_dial_announces_itself_relayed(peers, loop_thread):
    first = peers("relay", 1, limits=LimitsConfig(dial_back_timeout_s=DIAL_S))
    # Serving at 127.0.0.2, its calls leave from 127.0.0.1 (the kernel's source address towards 127.0.0.1): the
    # endpoint it announces is not where its calls come from, as behind NAT (the emulated NAT of
    # tests/test_netns_reachability.py shows the same through a real router).
    hidden = peers("relay", 0, host="127.0.0.2")
    verdict = hidden.reachability_verdict
    assert (verdict.reachability, verdict.asked) == (Reachability.RELAYED, first.peer_id)
    record = loop_thread.run(hidden.directory.stage_records(0))[hidden.peer_id]
    assert (record.reachability, record.state) == (Reachability.RELAYED, PeerState.SERVING)
    # the run's peers and trainers take it as relayed (no work sent its way); checks with no peer: unchecked
    unchecked = peers("relay", 1, reachability_check=False)
    assert unchecked.reachability_verdict is None and unchecked.reachability == Reachability.DIRECT
