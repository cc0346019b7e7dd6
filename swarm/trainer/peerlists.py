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


class PeerLists:
    """The peer lists part of a Pipeline (its ``records``, ``router``, ``reports`` and bans)."""

    async def refresh(self) -> None:
        fingerprint = self.run.fingerprint()
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
        for stage, found in enumerate(stages):
            compatible = {
                pid: r
                for pid, r in found.items()
                if r.config_hash == fingerprint
                and (listed_ids is None or pid in listed_ids)
                and self._dialable(r)
            }
            self.records[stage] = compatible
            self._update_router(stage, now)
        self._refreshed.set()

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
