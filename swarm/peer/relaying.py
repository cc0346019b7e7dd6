"""A peer behind NAT stays reachable through a relay of its run (swarm.transport.relay), and picks another when its
relay goes.

The relays are the run's directly reachable peers that announce a relay port. The peer opens an outbound control
channel to one of them (a random one, so relayed peers spread over relays), announces the endpoint it lends (with
``reachability: relayed`` and the relay's peer id) and forwards its callers into its own gRPC server. When the
channel is lost (the relay died, left or stopped answering keepalives) the peer announces its own, unreachable
endpoint without a relay at once (trainers then send it no work), leaves that relay out for a while, and takes
another: calls in flight through the dead relay fail and their trainers retry them elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from swarm.discovery.dht import RunDirectory
from swarm.states import PeerState, Reachability
from swarm.transport.callers import CallerCheck, CallerToken
from swarm.transport.dial import split_endpoint
from swarm.transport.relay import RelayError, RelayServer
from swarm.transport.relayconfig import RelayConfig
from swarm.transport.relaylink import RelayLink

logger = logging.getLogger(__name__)

RETRY_S = 2.0  # seconds between looks for a relay while none could be had
AVOID_S = 60.0  # a relay that failed or dropped this peer is left out this long


class Relaying:
    """Keeps this peer's relayed endpoint. ``on_change(endpoint, relay_peer_id)`` is awaited with each new
    relay's endpoint, and with ("", "") when the relay is lost (announce the peer unreachable until the next)."""

    def __init__(
        self,
        directory: RunDirectory,
        *,
        num_stages: int,
        peer_id: str,
        token: CallerToken,
        local_endpoint: str,
        on_change: Callable[[str, str], Awaitable[None]],
        rng: random.Random,
        timeout_s: float = 10.0,
    ):
        self.directory, self.num_stages, self.peer_id = directory, num_stages, peer_id
        self._token, self._on_change, self._rng, self._timeout_s = token, on_change, rng, timeout_s
        host, self._local_port = split_endpoint(local_endpoint)
        # the peer's server listens on its --host; 0.0.0.0 (all interfaces) is reached on loopback
        self._local_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self._avoid: dict[
            str, float
        ] = {}  # relay peer id -> until when (time.monotonic) it is left out
        self.link: RelayLink | None = None
        # set from the moment a link is found lost until on_change has been told (see lost_unsaid)
        self._losing = False
        self.relays_used = 0  # control channels opened in all
        self.has_relay = asyncio.Event()

    async def run_forever(self) -> None:
        try:
            while True:
                self.link = await self._connect()
                if self.link is None:
                    await asyncio.sleep(RETRY_S)  # the next look at the run's records
                    continue
                self.relays_used += 1
                self.has_relay.set()
                await self._on_change(self.link.endpoint, self.link.relay_peer_id)
                why = await self.link.serve()
                self._losing = True
                try:
                    logger.warning("%s: looking for another relay", why)
                    self._avoid[self.link.relay_peer_id] = time.monotonic() + AVOID_S
                    self.has_relay.clear()
                    await self.link.close()
                    self.link = None
                    await self._on_change("", "")
                finally:
                    self._losing = False
        finally:
            if self.link is not None:
                await self.link.close()

    def lost_unsaid(self) -> bool:
        """Whether the link was found lost and ``on_change`` has not yet been told (it is being told): the port
        callers reached this peer at is gone, and what that means for the samples it holds is still being seen to
        (any thread)."""
        return self._losing

    async def _candidates(self) -> list[tuple[str, str, int]]:
        """(peer id, host, relay port) of the run's serving, directly reachable peers that relay, in random order."""
        now = time.monotonic()
        out = []
        for records in await self.directory.all_stages(self.num_stages):
            for r in records.values():
                if (
                    r.state == PeerState.SERVING
                    and r.reachability == Reachability.DIRECT
                    and r.relay_port > 0
                    and r.peer_id != self.peer_id
                    and self._avoid.get(r.peer_id, 0.0) <= now
                ):
                    out.append((r.peer_id, split_endpoint(r.endpoint)[0], r.relay_port))
        out = sorted(set(out))
        self._rng.shuffle(out)
        return out

    async def _connect(self) -> RelayLink | None:
        """A link to the first relay that lends an endpoint; None when none did (each failure is logged)."""
        try:
            candidates = await self._candidates()
        except Exception as e:  # a DHT hiccup: look again later
            logger.warning("reading the run's relays failed: %s", e)
            return None
        if not candidates:
            logger.info(
                "no relay in the run yet (a directly reachable peer without --no-relay-for-others)"
            )
        for relay_peer_id, host, port in candidates:
            link = RelayLink(
                relay_host=host,
                relay_port=port,
                relay_peer_id=relay_peer_id,
                token=self._token,
                local_host=self._local_host,
                local_port=self._local_port,
                timeout_s=self._timeout_s,
            )
            try:
                endpoint = await link.open()
            except RelayError as e:
                logger.warning("%s", e)
                self._avoid[relay_peer_id] = time.monotonic() + AVOID_S
                continue
            logger.info("relay %s lends this peer the endpoint %s", relay_peer_id, endpoint)
            return link
        return None


async def start_relay_server(
    config: RelayConfig, caller_check: CallerCheck, *, bind_host: str, endpoint: str
) -> RelayServer:
    """This reachable peer's relay service on ``config.relay_port``, lending ports on the host of ``endpoint``
    (the address callers already dial) to the callers ``caller_check`` admits."""
    server = RelayServer(
        config,
        authenticate=caller_check.caller,
        public_host=split_endpoint(endpoint)[0],
        bind_host=bind_host,
    )
    port = await server.start(config.relay_port)
    logger.info(
        "relays for peers of the run behind NAT on port %d (at most %d peers, %d connections; "
        "--no-relay-for-others: off)",
        port,
        config.relay_max_peers,
        config.relay_max_connections,
    )
    return server


def relay_summary(server: RelayServer | None, relaying: Relaying | None) -> str:
    """The end of a peer's summary line about relaying ("" when it does none)."""
    if server is not None and (server.tenants or server.stats.connections):
        s = server.stats
        return (
            f", relays for {len(server.tenants)} peers ({s.connections} connections, "
            f"{s.relayed_bytes / 1e6:.1f} MB in all)"
        )
    if relaying is not None:
        link = relaying.link
        where = f"relay {link.relay_peer_id} at {link.endpoint}" if link else "no relay now"
        return f", reached through {where} ({relaying.relays_used} relays used)"
    return ""
