"""Is this peer reachable? Asked of a peer already in the run at start, answered by every serving peer.

A peer behind a home router or a cloud NAT can call out but nobody can call in: announcing its endpoint would
send trainers to an address that never answers. So a starting peer, once its server listens, asks a serving peer
of the run to connect back to the endpoint it means to announce (the DialBack RPC), and announces the answer in its
signed record (``StageRecord.reachability``: direct, or relayed when nobody could dial it), logging what the
operator can do about it.

The answering side dials only the address the call came from, at the port named (never a third party: DialBack
must not turn peers into a port scanner). An endpoint on any other host is answered "not reachable" without a dial,
naming the address the call came from: behind NAT that is the router's public address, the one to forward a port
on. With TLS the dial is a handshake with the certificate the caller will announce, so only the key's holder at that
endpoint passes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from dataclasses import dataclass

from swarm.discovery.dht import RunDirectory
from swarm.errors import InvalidRequest, SwarmError, WrongPeer
from swarm.identity import certified_key
from swarm.proto import swarm_pb2 as pb
from swarm.states import PeerState, Reachability
from swarm.transport.callers import CallerToken
from swarm.transport.client import PeerClient
from swarm.transport.dial import dial, peer_host, split_endpoint
from swarm.transport.security import PeerAddress

logger = logging.getLogger(__name__)

# Dials one answering peer runs at once; more callers wait their turn (their deadline bounds the wait).
MAX_CONCURRENT_DIALS = 4
MAX_CERT_CHARS = 16 << 10  # a PEM certificate of an RSA key is ~1-2 KiB
# A starting peer asks at most this many peers: the first answer decides, the others are for peers that fail.
MAX_ASKS = 3
ANSWER_MARGIN_S = 5.0  # beyond the dial's own bound, for the call's round trips


class DialBacks:
    """Answers DialBack calls for a serving peer of ``run_id``."""

    def __init__(self, run_id: str, *, timeout_s: float, dial=dial):
        self.run_id, self.timeout_s = run_id, timeout_s
        self._dial = dial
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_DIALS)

    async def answer(self, request: pb.DialBackRequest, peer: str) -> pb.DialBackReply:
        """The reply to ``request`` from the caller gRPC names ``peer`` (``context.peer()``)."""
        if request.run_id != self.run_id:
            raise WrongPeer(f"this peer serves run '{self.run_id}', not '{request.run_id}'")
        try:
            host, port = split_endpoint(request.endpoint)
        except ValueError as e:
            raise InvalidRequest(f"{e}: send the endpoint your server listens at") from None
        if request.tls_cert and (
            len(request.tls_cert) > MAX_CERT_CHARS or certified_key(request.tls_cert) is None
        ):
            raise InvalidRequest(
                "tls_cert is not a PEM certificate of an RSA key: send the certificate your server presents, "
                "or none for a plaintext server"
            )
        observed = peer_host(peer)
        if not observed:
            return pb.DialBackReply(
                detail=f"this peer cannot tell the address your call came from ({peer!r}), so it dials nothing"
            )
        announced = await _addresses(host, port)
        if observed not in announced:
            return pb.DialBackReply(
                observed_host=observed,
                detail=(
                    f"your call came from {observed}, but the endpoint {request.endpoint} is "
                    f"{'at ' + ', '.join(sorted(announced)) if announced else 'not resolvable'}: behind a NAT "
                    f"(or announcing another address) nobody can dial it. Not dialed: a peer dials back only "
                    f"the address a call came from"
                ),
            )
        target = f"[{observed}]:{port}" if ":" in observed else f"{observed}:{port}"
        async with self._slots:
            why = await self._dial(
                PeerAddress(target, tls_cert=request.tls_cert), timeout_s=self.timeout_s
            )
        return pb.DialBackReply(reachable=not why, observed_host=observed, detail=why)


async def _addresses(host: str, port: int) -> set[str]:
    """The IP addresses ``host`` stands for (itself if it is one); empty if it does not resolve."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {info[4][0] for info in infos}


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What a starting peer learned about its endpoint."""

    reachability: Reachability
    asked: str = ""  # the peer id that answered ("" = none did: unchecked, announced direct)
    observed_host: str = ""  # where the answering peer saw the call come from
    detail: str = ""  # why it is not reachable, or why it was not checked

    @property
    def checked(self) -> bool:
        return bool(self.asked)


async def check_reachability(
    directory: RunDirectory,
    *,
    num_stages: int,
    address: PeerAddress,
    token: CallerToken,
    timeout_s: float,
    rng: random.Random,
) -> Verdict:
    """Ask up to :data:`MAX_ASKS` serving, directly reachable peers of the run (but this one) to dial
    ``address`` back; the first answer decides. No answer (the first peer of a run, or none answered): direct,
    unchecked, with the reason in ``detail``. All the asks together take at most ``timeout_s`` plus twice
    :data:`ANSWER_MARGIN_S`: a frozen peer asked first must not hold the start for long."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s + 2 * ANSWER_MARGIN_S
    stages = await directory.all_stages(num_stages)
    candidates = [
        record
        for records in stages
        for record in records.values()
        if record.state == PeerState.SERVING
        and record.peer_id != address.peer_id
        and record.reachability == Reachability.DIRECT
    ]
    rng.shuffle(candidates)
    failures = []
    for record in candidates[:MAX_ASKS]:
        left_s = min(deadline - loop.time(), timeout_s + ANSWER_MARGIN_S)
        if left_s <= 0:
            failures.append("out of time")
            break
        client = PeerClient(PeerAddress.of(record), token=token)
        try:
            reply = await client.dial_back(
                directory.run_id, address.endpoint, address.tls_cert, timeout_s=left_s
            )
        except (
            SwarmError
        ) as e:  # an older peer (UNIMPLEMENTED), one that left, one overloaded: ask the next
            failures.append(f"{record.peer_id}: {type(e).__name__}")
            continue
        finally:
            await client.close()
        return Verdict(
            reachability=Reachability.DIRECT if reply.reachable else Reachability.RELAYED,
            asked=record.peer_id,
            observed_host=reply.observed_host,
            detail=reply.detail,
        )
    why = (
        f"no peer answered ({', '.join(failures)})"
        if failures
        else "no other serving peer in the run yet"
    )
    return Verdict(reachability=Reachability.DIRECT, detail=why)


def advice(verdict: Verdict, endpoint: str) -> str:
    """The log line for ``verdict`` about ``endpoint``: what was found and, if unreachable, what to do."""
    if not verdict.checked:
        return (
            f"reachability of {endpoint} not checked ({verdict.detail}): announced as direct; peers arriving later "
            f"check theirs against this one"
        )
    if verdict.reachability == Reachability.DIRECT:
        return f"{endpoint} is reachable: peer {verdict.asked} dialed it back"
    _, port = split_endpoint(endpoint)
    seen = verdict.observed_host or "your router's public address"
    return (
        f"{endpoint} is NOT reachable from the swarm: peer {verdict.asked} says {verdict.detail}. Announced as "
        f"relayed: it serves through a relay (a reachable peer of the run lends it an endpoint; callers' bytes "
        f"cross the relay's link twice, so it is slower). To serve directly, forward TCP "
        f"port {port} on your router (or open it in your firewall) to this machine, and start again with "
        f"--announce-host {seen} --port {port}; see deploy/README.md, 'A volunteer behind a home router'"
    )
