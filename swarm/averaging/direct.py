"""A step's all-reduce among exactly the replicas a trainer names, over the replicas' own gRPC servers.

hivemind forms each step's all-reduce group through the DHT (matchmaking: declare, look up, wait for the leader)
and runs it through libp2p daemons and a forked averager process per replica. In lockstep training every batch
waits for that, and on two cores those processes took about 0.9 of them (bench/results/convergence.md). Yet the
trainer already knows the group: when it closes a batch it asks every replica of the stage whether it is alive,
and the replicas that answer are the ones to average (``CloseBatchRequest.group``, in one order for all of them).

So each member splits its gradient sums (flat, float32) into ``len(group)`` contiguous parts; member i owns part i.
It sends its sums over part j, with its sample count, to member j (``ReducePart``), whose reply is part j's average:
the group's sums over the part divided by the group's samples. Its own part it adds locally. Every member takes the
owner's float32 result as it is, so the replicas end bit-identical. A part's owner answers once every member's
share is in, or fails the part after ``timeout_s`` (a member killed or frozen mid all-reduce): a member that
misses any part has no average and does not step on one (see ``HivemindStageOptimizer``, which then looks for the
trainer's next group, or loads its peers' state).

Who may contribute: the caller's id is the one its signed token proves (swarm.transport.callers), and it must be
among the members the call names; the owner must be the member whose part the call names. A part completes only
once the owner has added its own share, which it does only for the group its trainer gave it: a caller that lists a
made-up group can only wait out ``timeout_s``. Each part accepts one share per member, of the part's exact length,
finite (checked while decoding).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from swarm.errors import AllReduceFailed, InvalidRequest, SwarmError
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.transport.security import PeerAddress

logger = logging.getLogger(__name__)

# All-reduces a replica owns parts of at once (steps of several trainers' groups, a group a hostile caller made up);
# past it the oldest open one fails.
MAX_OPEN_PARTS = 16


@dataclass(frozen=True)
class Group:
    """The replicas one trainer's close names for a step's all-reduce, in part order."""

    step: int
    members: tuple[PeerAddress, ...]
    round: int = 0  # the trainer's try at this step's group (CloseBatchRequest.group_round)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(m.peer_id for m in self.members)

    @property
    def key(self) -> str:
        """Names the group: its step, members and round (the same members in another order, or in another round,
        are another group)."""
        return group_key(self.step, self.ids, self.round)

    @classmethod
    def from_request(cls, step: int, replicas: Sequence[pb.Replica], round: int = 0) -> Group:
        """The group a CloseBatch names; raises InvalidRequest for one that cannot be averaged with."""
        ids = [r.peer_id for r in replicas]
        if len(set(ids)) != len(ids) or not all(ids):
            raise InvalidRequest(
                f"the group of step {step} names a replica twice or one without an id: {ids}"
            )
        if not all(r.endpoint for r in replicas):
            raise InvalidRequest(f"the group of step {step} names a replica without an endpoint")
        return cls(
            step, tuple(PeerAddress(r.endpoint, r.peer_id, r.tls_cert) for r in replicas), round
        )


def group_key(step: int, ids: Sequence[str], round: int = 0) -> str:
    return hashlib.sha256(f"{step}\n{round}\n{chr(10).join(ids)}".encode()).hexdigest()[:32]


def part_spans(numel: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each of ``parts`` contiguous parts of ``numel`` values, sizes differing by at most one."""
    base, extra = divmod(numel, parts)
    spans, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        spans.append((start, end))
        start = end
    return spans


class _Part:
    """One part's rendezvous at its owner: the members' shares until all are in, then the average."""

    def __init__(self, members: tuple[str, ...], numel: int, loop: asyncio.AbstractEventLoop):
        self.members, self.numel = members, numel
        self.shares: dict[str, tuple[torch.Tensor, int]] = {}
        self.result: asyncio.Future[torch.Tensor] = loop.create_future()
        self.owner_in = False  # the owner contributed: this is the group its trainer gave it
        self.timer: asyncio.TimerHandle | None = None

    def fail(self, why: str) -> None:
        if not self.result.done():
            self.result.set_exception(AllReduceFailed(why))
            self.result.exception()  # retrieved: a part nobody waits for any more logs nothing
        if self.timer is not None:
            self.timer.cancel()


class OwnedParts:
    """The all-reduce parts this replica owns (event loop only): shares by (step, group key, part), averaged once all
    the group's members have sent theirs. ``current_step()``: the replica's optimizer step (shares for a step it
    has taken are refused)."""

    def __init__(self, peer_id: str, *, timeout_s: float, current_step: Callable[[], int]):
        self.peer_id, self.timeout_s, self.current_step = peer_id, timeout_s, current_step
        self._parts: OrderedDict[tuple[int, str, int], _Part] = OrderedDict()
        self.refused = 0  # shares refused (malformed, for a step taken, from a stranger)

    def check(self, meta: pb.ReduceMeta, sender: str, numel: int) -> int:
        """The length of the part ``meta`` names, from the stage's ``numel`` gradient values; raises InvalidRequest
        (or AllReduceFailed for a step already taken) naming what is wrong."""
        members = tuple(meta.members)
        try:
            if len(members) < 2 or len(set(members)) != len(members):
                raise InvalidRequest(
                    f"an all-reduce group holds 2 or more distinct replicas, got {list(members)}"
                )
            if sender not in members:
                raise InvalidRequest(
                    f"caller {sender} is not a member of the group it names ({list(members)})"
                )
            if not meta.part < len(members) or members[meta.part] != self.peer_id:
                raise InvalidRequest(
                    f"part {meta.part} of the group is not this peer's ({self.peer_id}); the group is "
                    f"{list(members)}"
                )
            if meta.step < self.current_step():
                raise AllReduceFailed(
                    f"this replica has taken step {self.current_step()} already; the all-reduce of step "
                    f"{meta.step} is over"
                )
        except SwarmError:
            self.refused += 1
            raise
        start, end = part_spans(numel, len(members))[meta.part]
        return end - start

    async def contribute(
        self,
        step: int,
        members: tuple[str, ...],
        part: int,
        sender: str,
        sums: torch.Tensor,
        samples: int,
        round: int = 0,
    ) -> torch.Tensor:
        """Add ``sender``'s share (its gradient sums over the part, and its samples) and wait for the part's average
        over the group: the sum of all shares' sums over the sum of their samples (zeros if no member had samples).
        Raises AllReduceFailed if the group's shares are not all in within ``timeout_s`` of the first."""
        loop = asyncio.get_running_loop()
        key = (step, group_key(step, members, round), part)
        entry = self._parts.get(key)
        if entry is None:
            entry = self._parts[key] = _Part(members, sums.numel(), loop)
            entry.timer = loop.call_later(self.timeout_s, self._expire, key)
            while len(self._parts) > MAX_OPEN_PARTS:
                old_key, old = self._parts.popitem(last=False)
                old.fail(f"more than {MAX_OPEN_PARTS} all-reduces open at this peer")
        if sums.numel() != entry.numel:
            raise InvalidRequest(f"a share of {sums.numel()} values for a part of {entry.numel}")
        if sender in entry.shares:
            self.refused += 1
            raise InvalidRequest(
                f"member {sender} sent its share of step {step}'s part {part} twice"
            )
        entry.shares[sender] = (sums, samples)
        entry.owner_in |= sender == self.peer_id
        if len(entry.shares) == len(members) and not entry.result.done():
            entry.result.set_result(_average(entry, members))
            entry.timer.cancel()
            self._parts.pop(key, None)
        return await asyncio.shield(entry.result)

    def _expire(self, key) -> None:
        entry = self._parts.pop(key, None)
        if entry is None:
            return
        missing = [m for m in entry.members if m not in entry.shares]
        entry.fail(
            f"the shares of {missing} did not come within {self.timeout_s:g}s (step {key[0]}, part {key[2]})"
        )

    def abandon(self, group: Group, part: int) -> None:
        """Fail this replica's part of a group it gave up on (the trainer named a newer one), unless complete."""
        entry = self._parts.pop((group.step, group.key, part), None)
        if entry is not None:
            entry.fail(f"this replica left the all-reduce of step {group.step} for a newer group")


def _average(entry: _Part, members: tuple[str, ...]) -> torch.Tensor:
    """The shares summed in member order (the same result wherever it is computed), over their samples."""
    total = torch.zeros(entry.numel, dtype=torch.float32)
    samples = 0
    for member in members:
        sums, n = entry.shares[member]
        total.add_(sums)
        samples += n
    return total.div_(samples) if samples else total


class DirectAllReduce:
    """Runs a replica's all-reduces with the groups its trainer names (see the module docstring): owns its parts
    (``parts``, reached by the ReducePart handler) and calls the other members for theirs. Event loop only, but
    :meth:`start` may be called from any thread. ``numel``: the stage's gradient values, all parts together."""

    def __init__(
        self,
        *,
        peer_id: str,
        run_id: str,
        stage: int,
        clients,  # swarm.transport.client.ClientPool, signing with this peer's identity
        loop: asyncio.AbstractEventLoop,
        timeout_s: float,
        current_step: Callable[[], int],
        numel: int,
    ):
        self.peer_id, self.run_id, self.stage, self.numel = peer_id, run_id, stage, numel
        self.clients, self.loop, self.timeout_s = clients, loop, timeout_s
        self.parts = OwnedParts(peer_id, timeout_s=timeout_s, current_step=current_step)
        # keys of the recent groups whose part this replica owns was completed (see own_part_completed)
        self._completed: OrderedDict[str, None] = OrderedDict()

    def own_part_completed(self, group: Group) -> bool:
        """Whether this replica's own part of ``group``'s all-reduce was completed (every member's share came in).
        Only then can another member have had every part and stepped on the group's average, this replica's samples
        in it, although this replica's all-reduce failed; if its own part never completed, nobody stepped on that
        group. Any thread."""
        return group.key in self._completed

    def start(self, group: Group, sums: torch.Tensor, samples: int):
        """Average ``sums`` (this replica's flat float32 gradient sums over ``samples`` samples) with ``group``: a
        concurrent future of the flat average (raises AllReduceFailed, or the call's error, when a part fails)."""
        return asyncio.run_coroutine_threadsafe(self.all_reduce(group, sums, samples), self.loop)

    async def all_reduce(self, group: Group, sums: torch.Tensor, samples: int) -> torch.Tensor:
        ids = group.ids
        if self.peer_id not in ids:
            raise InvalidRequest(f"this replica ({self.peer_id}) is not in the group {list(ids)}")
        spans = part_spans(sums.numel(), len(ids))

        async def part(index: int, member: PeerAddress) -> torch.Tensor:
            start, end = spans[index]
            share = sums[start:end]
            if member.peer_id == self.peer_id:
                average = await self.parts.contribute(
                    group.step, ids, index, self.peer_id, share, samples, group.round
                )
                self._completed[group.key] = None
                while len(self._completed) > MAX_OPEN_PARTS:
                    self._completed.popitem(last=False)
                return average
            meta = pb.ReduceMeta(
                protocol_version=PROTOCOL_VERSION,
                run_id=self.run_id,
                stage=self.stage,
                step=group.step,
                members=list(ids),
                part=index,
                samples=samples,
                round=group.round,
            )
            # the owner may wait timeout_s for the last share; the call allows for the transfer on top
            return await self.clients.get(member).reduce_part(
                meta, share, timeout_s=self.timeout_s + 5.0
            )

        tasks = [asyncio.ensure_future(part(i, m)) for i, m in enumerate(group.members)]
        try:
            averages = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Its own part left open could still complete for the others, who would then step on the group while
            # this replica does not: close it (if it completed already, see own_part_completed).
            self.parts.abandon(group, ids.index(self.peer_id))
            raise
        return torch.cat(averages) if averages else sums.new_zeros(0)
