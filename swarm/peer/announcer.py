"""A peer's heartbeat in the DHT: the record of the stage it serves, and during a move or on arrival a
"starting" record on the stage it is heading to, so others count its capacity where it is going.

The announcer reads the peer through two getters (its endpoint, and a :class:`Serving` snapshot of the
stage it serves), never the peer itself; where the peer is heading and when it last moved are told to it
(:meth:`Announcer.heading_to`, :meth:`Announcer.settled`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from swarm.config import RunConfig
from swarm.discovery.dht import RunDirectory
from swarm.discovery.records import StageRecord
from swarm.discovery.watch import DHTWatch
from swarm.states import PeerState, Reachability

logger = logging.getLogger(__name__)

# The run's config lives this many record TTLs, refreshed RUN_REFRESHES times in that span, not every heartbeat (its two
# records cost a DHT store each and do not change): readable while any peer serves the run.
RUN_TTL_FACTOR = 12
RUN_REFRESHES = 4
# A beat waits at most this many lifetimes of a record for the DHT node (a store that takes longer keeps no one's
# view of this peer alive anyway); the next beat asks again.
BEAT_TIMEOUT_TTLS = 2


@dataclass(frozen=True, kw_only=True)
class Serving:
    """The numbers a peer announces for the stage it serves, read at each heartbeat."""

    stage_index: int
    state: PeerState
    throughput: float  # samples/s, forward + backward
    in_flight: int  # calls being handled
    step: int  # optimizer steps of its replica
    step_pause_s: float  # how long its optimizer steps hold its compute
    param_digest: str = ""  # digest of its parameters at `step` ("" = not hashed yet)
    device: str = ""  # where its stage computes (torch device of its parameters)
    dtype: str = ""  # its compute dtype (fp32, bf16, fp16)
    memory_bytes: int = 0  # its estimate of the memory its stage takes on the device
    device_memory_bytes: int = 0  # all the memory of that device (0 = not known)
    averaging: bool = False  # whether it all-reduces with its stage's other replicas (--average)


class Announcer:
    def __init__(
        self,
        directory: RunDirectory,
        run: RunConfig,
        *,
        peer_id: str,
        ttl_s: float,
        heartbeat_s: float,
        endpoint: Callable[[], str],
        serving: Callable[[], Serving | None],
        tls_cert: Callable[[], str] = str,
        reachability: Callable[[], Reachability] = lambda: Reachability.DIRECT,
        relaying: Callable[[], tuple[str, int]] = lambda: ("", 0),
        watch: DHTWatch | None = None,
    ):
        self.directory, self.run, self.peer_id = directory, run, peer_id
        self.ttl_s, self.heartbeat_s = ttl_s, heartbeat_s
        self._endpoint = endpoint
        self._tls_cert = tls_cert  # the certificate its server presents ("" = plaintext)
        self._reachability = (
            reachability  # whether callers can dial its endpoint (checked at start)
        )
        # (the relay whose endpoint it announces, the port of its own relay service): see StageRecord
        self._relaying = relaying
        self._serving = serving  # None until the peer serves a stage
        # sees each beat answered, or the DHT node lost (None: beats wait as long as the node takes)
        self._watch = watch
        self._heading_to: tuple[int, float] | None = None  # (stage index, expected samples/s)
        self.last_moved_s = 0.0  # DHT time of the arrival or the last change of stage (0 = not yet)

    def heading_to(self, stage_index: int | None, expected_throughput: float = 0.0) -> None:
        """Announce "starting" on ``stage_index`` (None: on no stage, e.g. when leaving the swarm)."""
        self._heading_to = None if stage_index is None else (stage_index, expected_throughput)

    def settled(self) -> None:
        """The peer arrived at (or moved to) the stage it serves now: no "starting" record, and the
        rebalancing cooldown counts from here."""
        self._heading_to = None
        self.last_moved_s = get_dht_time()

    def records(self) -> list[StageRecord]:
        """What this peer announces: its stage, and during a move a "starting" record on the target."""
        config_hash, now = self.run.fingerprint(), get_dht_time()
        relay_peer_id, relay_port = self._relaying()
        out = []
        serving = self._serving()
        if serving is not None:
            out.append(
                StageRecord(
                    peer_id=self.peer_id,
                    endpoint=self._endpoint(),
                    stage=serving.stage_index,
                    state=serving.state,
                    throughput=serving.throughput,
                    in_flight=serving.in_flight,
                    step=serving.step,
                    config_hash=config_hash,
                    last_moved_s=self.last_moved_s,
                    step_pause_s=serving.step_pause_s,
                    param_digest=serving.param_digest,
                    device=serving.device,
                    dtype=serving.dtype,
                    memory_bytes=serving.memory_bytes,
                    device_memory_bytes=serving.device_memory_bytes,
                    averaging=serving.averaging,
                    announced_s=now,
                    tls_cert=self._tls_cert(),
                    reachability=self._reachability(),
                    relay_peer_id=relay_peer_id,
                    relay_port=relay_port,
                )
            )
        if self._heading_to is not None:
            target, expected = self._heading_to
            out.append(
                StageRecord(
                    peer_id=self.peer_id,
                    endpoint=self._endpoint(),
                    stage=target,
                    state=PeerState.STARTING,
                    throughput=expected,
                    in_flight=0,
                    step=0,
                    config_hash=config_hash,
                    last_moved_s=self.last_moved_s,
                    announced_s=now,
                    tls_cert=self._tls_cert(),
                    reachability=self._reachability(),
                    relay_peer_id=relay_peer_id,
                    relay_port=relay_port,
                )
            )
        return out

    async def announce(self) -> None:
        for record in self.records():
            await self.directory.announce(record, ttl_s=self.ttl_s)

    async def _beat(self, publish_run: bool) -> float | None:
        """One beat: the records, and the run's config if ``publish_run``; returns when that was published (None:
        not this beat). Under the watch, a beat the node leaves unanswered for BEAT_TIMEOUT_TTLS lifetimes of a
        record times out (the next beat asks again)."""

        async def beat() -> float | None:
            await self.announce()
            if not publish_run:
                return None
            await self.publish_run()
            return get_dht_time()

        if self._watch is None:
            return await beat()
        return await self._watch.ask(beat(), timeout_s=self.ttl_s * BEAT_TIMEOUT_TTLS)

    async def publish_run(self) -> None:
        """Publish the run's config (a new run), or keep it alive in the DHT."""
        await self.directory.publish_run(self.run, ttl_s=self.ttl_s * RUN_TTL_FACTOR)

    async def run_forever(self) -> None:
        """Heartbeat every ``heartbeat_s`` until cancelled: the peer's records each beat, the run's config
        ``RUN_REFRESHES`` times per its lifetime (and at each beat after a failed refresh)."""
        run_refresh_s = self.ttl_s * RUN_TTL_FACTOR / RUN_REFRESHES
        run_published_s = -float("inf")
        while True:
            try:
                published = await self._beat(get_dht_time() - run_published_s >= run_refresh_s)
                run_published_s = published or run_published_s
            except asyncio.TimeoutError:
                logger.warning(
                    "announcement took over %.0fs: the DHT node did not answer (retrying)",
                    self.ttl_s * BEAT_TIMEOUT_TTLS,
                )
            except Exception as e:  # a DHT hiccup must not kill the peer; the next beat retries
                logger.warning("announcement failed: %s", e)
            await asyncio.sleep(self.heartbeat_s)
