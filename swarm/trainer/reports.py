"""A trainer's side of ban reports (swarm.discovery.banreports): it publishes one for each peer it bans for a
proven fault, and reads everyone's at each refresh of the peer lists.

What it reads decides two sets the pipeline routes by: ``avoided`` (a quorum of distinct reporters, or the run's
owner, reported the peer: no work goes there) and ``suspects`` (reported, but not enough: every forward call to them
is spot-checked, so the trainer bans them itself if they lie, and a false report costs them nothing but checks).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

import torch

from swarm.discovery.banreports import (
    BanReport,
    Verdict,
    publish_ban_report,
    read_ban_reports,
    weigh_reports,
)

logger = logging.getLogger(__name__)

# How long closing the trainer waits for reports still being published.
CLOSE_WAIT_S = 10.0


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 (first 16 hex digits) of a tensor's float32 values: names a result in a report."""
    data = tensor.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


class ReportBook:
    def __init__(self, directory, *, quorum: int, ttl_s: float):
        self.directory, self.quorum, self.ttl_s = directory, quorum, ttl_s
        self.verdicts: dict[str, Verdict] = {}
        self.avoided: frozenset[str] = frozenset()  # peers a quorum (or the run's owner) reported
        self.suspects: frozenset[str] = (
            frozenset()
        )  # peers reported by fewer: spot-check every call
        self.published = 0  # reports the DHT took
        self._tasks: set[asyncio.Task] = set()

    def report(self, report: BanReport) -> None:
        """Publish ``report`` in the background (a failure is logged: the ban stands either way)."""
        task = asyncio.create_task(self._publish(report), name="ban-report")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, report: BanReport) -> None:
        try:
            stored = await publish_ban_report(self.directory, report, ttl_s=self.ttl_s)
        except Exception as e:  # the DHT's failures are many kinds; the ban holds anyway
            logger.warning("publishing the ban report on peer %s failed: %s", report.peer_id, e)
            return
        if stored:
            self.published += 1
            logger.info("reported peer %s in the DHT (%s)", report.peer_id, report.kind)
        else:
            logger.warning("the DHT refused the ban report on peer %s", report.peer_id)

    async def refresh(self, *, admitted: frozenset[str] | None) -> None:
        """Read the run's reports and weigh them (``admitted``: the peer ids the run's caller list admits, None
        for an open run). The run's owner and this trainer are trusted; others need a quorum."""
        reports = await read_ban_reports(self.directory)
        identity = self.directory.identity
        trusted = {self.directory.owner} if self.directory.owner else set()
        if identity is not None:
            trusted.add(identity.peer_id)
        self.verdicts = weigh_reports(
            reports, quorum=self.quorum, trusted=trusted, admitted=admitted
        )
        avoided = frozenset(p for p, v in self.verdicts.items() if v.avoid)
        for peer in avoided - self.avoided:
            logger.warning(
                "peer %s is avoided: reported by %d trainer(s) (%s)",
                peer,
                len(self.verdicts[peer].reporters),
                self.verdicts[peer].reports[0].reason,
            )
        self.avoided = avoided
        self.suspects = frozenset(self.verdicts) - avoided

    async def close(self) -> None:
        """Let the reports under way land (bounded), then stop."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=CLOSE_WAIT_S)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
