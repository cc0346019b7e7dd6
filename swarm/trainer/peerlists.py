"""The trainer's view of the run's peers: every stage's records, refreshed from the DHT, and which of them routing
may pick (serving, not draining by a recent reply, not banned, not avoided on other trainers' reports). A part of
:class:`swarm.trainer.pipeline.Pipeline`, whose fields it reads and keeps."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from swarm.discovery.callerlist import read_caller_list
from swarm.discovery.records import StageRecord
from swarm.errors import StageUnavailable
from swarm.identity import PEER_ID_HEX
from swarm.states import PeerState
from swarm.trainer.work import BACKWARD_COST, FORWARD_COST

logger = logging.getLogger(__name__)

# How long a "draining" seen in a reply outweighs a DHT record that still says "serving".
DRAINING_MEMORY_S = 30.0
# How long after a peer last answered this trainer its record is kept without asking it, once the DHT no longer
# lists it (a peer's default record lifetime, swarm.peer.config): see PeerLists.refresh.
ANSWERED_KEEPS_S = 5.0


class PeerLists:
    """The peer lists part of a Pipeline (its ``records``, ``router``, ``reports`` and bans)."""

    async def refresh(self) -> None:
        fingerprint = self.run.fingerprint()
        started = time.monotonic()
        stages, listed = await asyncio.gather(
            self.directory.all_stages(self.num_stages), read_caller_list(self.directory)
        )
        # a run whose owner lists its callers: only listed peers get work (others cannot join its peers anyway)
        admitted = None if listed is None else listed.admitted(self.directory.owner)
        listed_ids = None if admitted is None else {entry[:PEER_ID_HEX] for entry in admitted}
        try:
            await self.reports.refresh(
                admitted=None if listed_ids is None else frozenset(listed_ids)
            )
        except Exception as e:  # route on the last verdicts
            logger.warning("reading the run's ban reports failed: %s", e)
        now = time.monotonic()
        if now - started > self.config.refresh_s:
            logger.debug("reading the peer lists from the DHT took %.1fs", now - started)
        # A peer this trainer knew that this read does not list, but that answers it, serves: a DHT slow to read or
        # to store (one frozen node among the neighbours makes every request to it wait out its timeout) leaves out
        # records that expire meanwhile. Dropped, every peer of a stage could vanish at once, and the trainer stopped
        # sending work and closing batches where it was answered (test_averaging's kill/freeze test: a lockstep
        # trainer found no peer listed, seconds at a time, while one replica was frozen). Its last record is kept
        # while it answers: a call or Info of the last ANSWERED_KEEPS_S, or else its Info now (a frozen peer does
        # not answer, a killed one refuses: both are dropped).
        listed_anywhere = {pid for found in stages for pid in found}
        unlisted = [
            (stage, record)
            for stage in range(self.num_stages)
            for pid, record in self.records[stage].items()
            if pid not in listed_anywhere and (listed_ids is None or pid in listed_ids)
        ]
        answering = await asyncio.gather(
            *(self._answers_still(stage, record, now) for stage, record in unlisted)
        )
        kept = [unlisted[i] for i, ok in enumerate(answering) if ok]
        now = time.monotonic()
        for stage, found in enumerate(stages):
            compatible = {
                pid: r
                for pid, r in found.items()
                if r.config_hash == fingerprint
                and (listed_ids is None or pid in listed_ids)
                and self._dialable(r)
            }
            compatible.update({r.peer_id: r for k, r in kept if k == stage})
            if logger.isEnabledFor(logging.DEBUG) and set(compatible) != set(self.records[stage]):
                logger.debug(
                    "stage %d: peers %s (were %s; kept unlisted, answering: %s)",
                    stage,
                    sorted(compatible),
                    sorted(self.records[stage]),
                    sorted(r.peer_id for k, r in kept if k == stage),
                )
            self.records[stage] = compatible
            self._update_router(stage, now)
        self.steps.forget_answers(older_than_s=ANSWERED_KEEPS_S, now=now)
        self._refreshed.set()

    async def _answers_still(self, stage: int, record: StageRecord, now: float) -> bool:
        """Whether the peer of ``record`` answered this trainer as a replica of ``stage`` in the last
        ANSWERED_KEEPS_S, or answers its Info now."""
        if self.steps.silent_for(stage, record.peer_id, now) < ANSWERED_KEEPS_S:
            return True
        return await self.steps.answers(stage, record)

    def _dialable(self, record: StageRecord) -> bool:
        """Whether this trainer can call the peer: directly, or through the relay it announces. A relayed one
        without a relay (behind NAT, between relays) is left out, said once per peer."""
        if record.callable:
            return True
        if record.peer_id not in self._unreachable:
            self._unreachable.add(record.peer_id)
            logger.info(
                "peer %s of stage %d announces itself relayed but names no relay (nobody could dial %s): this "
                "trainer sends it no work until it does",
                record.peer_id,
                record.stage,
                record.endpoint,
            )
        return False

    def _update_router(self, stage: int, now: float) -> None:
        """Route new work only to serving peers. A peer that said "draining" in a reply is left out for a
        while even if its DHT record still says serving (the record may be a heartbeat behind). A draining
        replica hands in the gradients it holds itself (its stage's all-reduce takes them before it leaves): the
        trainer never computes them again."""
        for k, peer in self._draining_replies:
            if k == stage:
                self.holdings.release(stage, peer)
        for peer, record in self.records[stage].items():
            if record.state == PeerState.DRAINING:
                self.holdings.release(stage, peer)
        self._draining_replies = {
            k: t for k, t in self._draining_replies.items() if now - t < DRAINING_MEMORY_S
        }
        # Peers announce samples/s of forward + backward; routing counts in forward-sample units.
        serving = {
            pid: r.throughput * (FORWARD_COST + BACKWARD_COST)
            for pid, r in self.records[stage].items()
            if r.state == PeerState.SERVING
            and (stage, pid) not in self._draining_replies
            and pid not in self.banned_for_run
            and pid not in self.reports.avoided
        }
        self.router.update_peers(stage, serving, now)

    async def _next_refresh(self, *, timeout_s: float) -> None:
        """Wait for the next refresh of the peer lists, at most ``timeout_s`` (no waiter is left behind)."""
        self._refreshed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._refreshed.wait(), timeout=timeout_s)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            try:
                await self.refresh()
            except Exception as e:  # keep routing on the last known lists
                logger.warning("refreshing peers from the DHT failed: %s", e)

    async def wait_for_peers(self, *, timeout_s: float) -> None:
        """Wait until every stage has at least one serving peer."""
        deadline = time.monotonic() + timeout_s
        while True:
            empty = [s for s in range(self.num_stages) if not self.router.peers(s)]
            if not empty:
                return
            if time.monotonic() > deadline:
                raise StageUnavailable(
                    f"no peer serves stage(s) {empty} of run '{self.run_id}' after "
                    f"{timeout_s:.0f}s; start `swarm peer --run-id {self.run_id} --stage "
                    f"{empty[0]}`"
                )
            await self._next_refresh(timeout_s=self.config.refresh_s * 2)
