"""Where each stage's optimizer stands as one trainer knows it, and the trainer's side of closing global batches.

Averaging replicas step once per global batch, a little after its last microbatch (the all-reduce). The trainer
reads their steps from the DHT records, the replies of its calls, and, while it waits for a stage in lockstep,
the replicas' own ``Info`` (a local round trip instead of a heartbeat); it closes each batch at every replica
(``CloseBatch``) with the count of the stage's replicas that answered just before, so a stage steps on what it
has and knows whom to step with.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable

import grpc

from swarm.discovery.records import StageRecord
from swarm.errors import SwarmError
from swarm.states import PeerState
from swarm.trainer.holdings import Holdings
from swarm.transport.client import ClientPool
from swarm.transport.dial import refuses
from swarm.transport.security import PeerAddress

logger = logging.getLogger(__name__)

# Deadline of the calls that close a global batch (see StageSteps.close_batch), and how often a stage that is
# behind is closed again.
CLOSE_BATCH_TIMEOUT_S = 5.0
RECLOSE_EVERY_S = 2.0
# How long a replica may hold the first close of a batch until it has stepped on it (its answer then says the
# step: the trainer in lockstep learns of it in that round trip; see wait_for_stage_steps)
CLOSE_WAIT_FOR_STEP_S = 2.0
# How long a replica whose call failed UNAVAILABLE is given to accept a TCP connection before it counts as gone
REFUSED_PROBE_TIMEOUT_S = 2.0
# While the trainer waits for stages to step: seconds between two reads of their replicas' steps (Info), and
# how long one read may take
STEP_POLL_S, STEP_POLL_TIMEOUT_S = 0.05, 1.0


class StageSteps:
    """The optimizer steps of the stages of one run, over the pipeline's records (stage -> peer id -> record,
    refreshed in place by the pipeline)."""

    def __init__(
        self,
        records: list[dict[str, StageRecord]],
        clients: ClientPool,
        run_id: str,
        *,
        holdings: Holdings | None = None,
    ):
        self.records, self.clients, self.run_id = records, clients, run_id
        self.holdings = holdings
        # the highest optimizer step any reply of each stage carried
        self._replied_steps = [0] * len(records)
        # (stage, peer id) -> the optimizer step its Info answered while the trainer waited for its stage to step, or
        # its last reply carried (the DHT record says it a heartbeat later); by stage, since a peer that moved counts
        # steps of another
        self._polled_steps: dict[tuple[int, str], int] = {}
        # peers whose Info was refused (the process is gone) since they last answered: their records outlive them
        # by up to their TTL, and waiting for every replica must not wait for them
        self._gone: set[str] = set()
        # (stage, peer id) of replicas seen draining their stage (a drain ends in leaving it)
        self._draining: set[tuple[int, str]] = set()
        # (stage, peer id) -> the last record seen of each replica: a replica holding samples of a batch being closed
        # is asked even when its record has expired between heartbeats (see close_batch)
        self._last_records: dict[tuple[int, str], StageRecord] = {}
        # set when a reply tells of a step (see replied): wakes wait_for_stage_steps between its polls
        self._news = asyncio.Event()
        # stage -> (batch step, round): the try at that step's group to name next, raised past a round whose direct
        # all-reduce a member answered failed (CloseBatchReply.retry_round; see close_batch)
        self._rounds: dict[int, tuple[int, int]] = {}
        # (stage, peer id) -> when it last answered this trainer as a replica of that stage (a call's reply, a
        # close's, its Info): the peer lists keep a record the DHT lost while its peer answers (see PeerLists.refresh)
        self.answered: dict[tuple[int, str], float] = {}
        # stage -> the last batch step whose close found every replica it asked answering at that step, all named in
        # the group (see closed_soundly)
        self._sound: dict[int, int] = {}
        # (stage, peer id) -> (the step its last Info answered at, {step: the replicas whose gradients that step
        # averaged} for its last steps whose makers it knows: InfoResponse.averaged_steps)
        self._makers: dict[tuple[int, str], tuple[int, dict[int, frozenset[str]]]] = {}

    def replied(self, stage: int, step: int, peer: str | None = None) -> None:
        """A reply of ``stage`` said its replica (``peer``, if known) is at optimizer step ``step``: the trainer
        knows that replica's step without asking its ``Info`` while microbatches are in flight."""
        self._replied_steps[stage] = max(self._replied_steps[stage], step)
        if peer is not None:
            key = (stage, peer)
            self._polled_steps[key] = max(self._polled_steps.get(key, 0), step)
            self.answered[key] = time.monotonic()
        self._news.set()

    def silent_for(self, stage: int, peer: str, now: float) -> float:
        """Seconds since ``peer`` last answered this trainer as a replica of ``stage`` (inf: never)."""
        return now - self.answered.get((stage, peer), -math.inf)

    def forget_answers(self, *, older_than_s: float, now: float) -> None:
        """Forget who answered longer ago than ``older_than_s``: in a long run, peers come and go by the hundred."""
        self.answered = {k: t for k, t in self.answered.items() if now - t < older_than_s}

    def stages_average(self) -> bool:
        """Whether every serving replica of every stage averages with its stage (``swarm peer``'s default):
        then the stages step once per global batch, together."""
        serving = [
            r for stage in self.records for r in stage.values() if r.state == PeerState.SERVING
        ]
        return bool(serving) and all(r.averaging for r in serving)

    def solo_replicas(self) -> dict[int, int]:
        """Stage -> count of its serving replicas, for each stage served by more than one replica that does not
        average (``--no-average``): each of them steps on its own count of samples, so the stage's step does not
        count global batches and a limit on batches ahead cannot be met."""
        out = {}
        for stage, records in enumerate(self.records):
            serving = [r for r in records.values() if r.state == PeerState.SERVING]
            if len(serving) > 1 and not all(r.averaging for r in serving):
                out[stage] = len(serving)
        return out

    def stage_steps(self, *, every_replica: bool = False) -> list[int]:
        """Each stage's optimizer step as far as this trainer knows (DHT records, and the step peers put in
        their replies): the most advanced replica's, or with ``every_replica`` the least advanced's."""
        out = []
        for stage in range(len(self.records)):
            steps = [
                max(r.step, self._polled_steps.get((stage, r.peer_id), 0))
                for r in self.records[stage].values()
                if r.state == PeerState.SERVING and not (every_replica and r.peer_id in self._gone)
            ]
            if every_replica:
                out.append(min(steps, default=0))
            else:
                out.append(max([*steps, self._replied_steps[stage]]))
        return out

    async def wait_for_stage_steps(
        self,
        targets: list[int],
        *,
        stall_s: float,
        every_replica: bool = False,
        ready: Callable[[], bool] = lambda: False,
    ) -> bool:
        """Wait until each stage k has taken optimizer step ``targets[k]`` (with ``every_replica``: each of its
        serving replicas has), or ``ready()`` says to go on before (checked whenever a reply or a close brings
        news). Gives up (False) once no stage has advanced for ``stall_s``. Every batch before the targets is
        complete: a stage that is behind is closed again every ``RECLOSE_EVERY_S`` with a fresh count of its
        replicas (one that died since the batch was closed would otherwise be waited for)."""
        deadline, last = time.monotonic() + stall_s, None
        reclosed = time.monotonic()
        while True:
            self._news.clear()
            steps = self.stage_steps(every_replica=every_replica)
            behind = [k for k, target in enumerate(targets) if steps[k] < target]
            if not behind or ready():
                return True
            if time.monotonic() - reclosed >= RECLOSE_EVERY_S:
                await self.close_batch(
                    [steps[k] if k in behind else None for k in range(len(steps))]
                )
                reclosed = time.monotonic()
            if steps != last:
                deadline, last = time.monotonic() + stall_s, steps
            elif time.monotonic() > deadline:
                logger.warning(
                    "stage(s) %s stopped short of optimizer step %s (they are at %s)",
                    behind,
                    [targets[k] for k in behind],
                    [steps[k] for k in behind],
                )
                return False
            # Ask the replicas of the stages behind (a local round trip), rather than wait a heartbeat for their
            # DHT records to say it: in lockstep training every batch waits here. A close still waiting for a
            # replica's step (CLOSE_WAIT_FOR_STEP_S) ends this wait as soon as it is answered.
            await asyncio.gather(*(self._poll_steps(k) for k in behind))
            # (the pipeline refreshes the records meanwhile: a DHT read here would hold this wait as long as the DHT
            # takes, seconds when one of its nodes is frozen)
            await self.news(STEP_POLL_S)

    async def news(self, timeout_s: float) -> None:
        """Wait until a reply or a close brings news of a step (see replied), at most ``timeout_s``."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._news.wait(), timeout_s)

    async def poll(self) -> None:
        """Read every serving replica's step from its Info now: the steps the DHT records say may be a heartbeat
        old (a trainer starting right after another's last batch would tag its batches with steps already taken)."""
        await asyncio.gather(*(self._poll_steps(k) for k in range(len(self.records))))

    async def _poll_steps(self, stage: int) -> None:
        """Read the optimizer step of each serving replica of ``stage`` from its Info (best effort: one that does
        not answer keeps the step its record says)."""

        serving = [r for r in self.records[stage].values() if r.state == PeerState.SERVING]
        await asyncio.gather(*(self.answers(stage, r) for r in serving))

    async def answers(self, stage: int, record: StageRecord) -> bool:
        """Whether the peer of ``record`` answers its Info now, as a replica of ``stage`` (its step noted). Best
        effort, within STEP_POLL_TIMEOUT_S."""
        try:
            info = await self.clients.get(PeerAddress.of(record)).info(
                self.run_id, timeout_s=STEP_POLL_TIMEOUT_S
            )
        except SwarmError as e:
            # refused or reset (not a deadline: a frozen or busy peer may come back): the process is gone
            if getattr(e, "status", None) == grpc.StatusCode.UNAVAILABLE:
                self._gone.add(record.peer_id)
            return False
        self._gone.discard(record.peer_id)
        return self._saw_step(stage, record, info)

    async def close_batch(
        self, batch_steps: list[int | None], *, wait_for_step_s: float = 0.0
    ) -> None:
        """Tell every replica of each stage k that this trainer's part of its global batch ``batch_steps[k]`` is all
        committed, so the stage steps on what it has rather than wait for samples that will not come (a replica
        killed with its part), and how many of its replicas answered just now: the replicas to step with, whatever
        the stage's progress records (which outlive a killed replica, and lag a live one) say; no count (0) when a
        replica did not answer in time (it may be busy, not gone). Best effort: a replica that does not answer
        steps on its own rules. ``batch_steps[k]`` None: leave stage k alone. ``wait_for_step_s``: each replica
        answers once it has stepped on the batch, or after that long; its answer's step counts as a reply's."""
        targets = [
            (stage, record)
            for stage in range(len(self.records))
            if batch_steps[stage] is not None
            for record in list(self.records[stage].values())
            if record.state in (PeerState.SERVING, PeerState.DRAINING)
        ]
        for stage, record in targets:
            self._last_records[(stage, record.peer_id)] = record
        targets += self._unlisted_holders(batch_steps)
        self._forget_unheld_records()

        async def alive(stage: int, record: StageRecord) -> bool | str | None:
            """True: it answered as a replica of ``stage``. False: it answered as something else (moved, starting).
            "refused": it is gone (the connection refused or reset). None: no answer in time, or an error that says
            nothing of whether it lives (busy or frozen: nobody can tell which from here)."""
            try:
                info = await self.clients.get(PeerAddress.of(record)).info(
                    self.run_id, timeout_s=CLOSE_BATCH_TIMEOUT_S
                )
                # A replica that moved to another stage (or is on its way there, "starting") answers from its
                # address, but it no longer takes part in this stage's step: counted, it would make the replicas
                # left wait for it in their all-reduce group.
                return self._saw_step(stage, record, info)
            except SwarmError as e:
                status = getattr(e, "status", None)
                # "refused": no process behind its address (the connection refused or reset). Any other error
                # (an overloaded peer refusing the call, say) is no sign it left: counted as gone, it would tell its
                # peers they step without it while it steps on its own part of the batch.
                if status != grpc.StatusCode.UNAVAILABLE:
                    return None
                # UNAVAILABLE also ends the calls to a frozen peer (its channel's keepalive ping timed out). Taken for
                # gone, its samples of the batch were computed again elsewhere, and on coming back it added its own
                # copy to the stage's step as well (a microbatch applied twice). Gone only if its port is closed.
                gone = await refuses(record.endpoint, timeout_s=REFUSED_PROBE_TIMEOUT_S)
                return "refused" if gone else None

        answered = await asyncio.gather(*(alive(*target) for target in targets))
        if self.holdings is not None and self.holdings.enabled:
            await self._redo_for_gone(
                batch_steps,
                [target for target, ok in zip(targets, answered) if ok == "refused"],
                [target for target, ok in zip(targets, answered) if ok is True],
            )
        live = [0] * len(self.records)
        for (stage, _), ok in zip(targets, answered):
            live[stage] += ok is True
        # A replica that did not answer in time may be alive and busy: a count without it could tell the others
        # they are alone, and each would step on its own part of the batch. Send no count (0: the replicas go by
        # the stage's progress records, which drop a frozen replica once its record expires).
        for (stage, record), ok in zip(targets, answered):
            if ok == "refused":
                self._gone.add(record.peer_id)
            if ok is None:
                live[stage] = 0
            if ok is not True:
                logger.debug(
                    "stage %d peer %s: not counted in closing its batch (%s)",
                    stage,
                    record.peer_id,
                    ok,
                )

        for stage, record in targets:
            if record.state == PeerState.DRAINING:
                self._draining.add((stage, record.peer_id))
        for stage in range(len(self.records)):
            # One replica tells it to step alone. Only say so when another replica of the stage is known to have
            # left: on a loaded machine the others' records expire between heartbeats, and a replica told it is
            # alone while they average drifts apart from them.
            refused = any(ok == "refused" for (k, _), ok in zip(targets, answered) if k == stage)
            if live[stage] == 1 and not (refused or self._one_left(stage)):
                live[stage] = 0

        # Each stage's replicas that answered at the batch's step (or the one before: still averaging it, when the
        # trainer runs a batch ahead), in one order for all of them: the group a replica that averages directly
        # (swarm.averaging.direct) averages with; the others go by the count. (A replica further behind, a newcomer
        # still loading its peers' state say, would not take part: the group would wait for it in vain.)
        groups: list[list[PeerAddress]] = [[] for _ in self.records]
        for (stage, record), ok in zip(targets, answered):
            if (
                ok is True
                and batch_steps[stage] - 1
                <= self._polled_steps.get((stage, record.peer_id), -2)
                <= batch_steps[stage]
                and all(a.peer_id != record.peer_id for a in groups[stage])
            ):
                groups[stage].append(PeerAddress.of(record))
        for group in groups:
            group.sort(key=lambda address: address.peer_id)
        # A stage whose every replica asked answered at the batch's step (all of them then in its group): closed
        # soundly (see closed_soundly)
        unsound = {
            stage
            for (stage, record), ok in zip(targets, answered)
            if ok is not True
            or self._polled_steps.get((stage, record.peer_id)) != batch_steps[stage]
        }
        for stage in {
            stage for stage, _ in targets
        } - unsound:  # (targets: stages with a batch step only)
            self._sound[stage] = max(self._sound.get(stage, -1), batch_steps[stage])
            self._news.set()
        # Its round: a member whose all-reduce with the group failed (a share that did not come, from a groupmate
        # frozen a moment or whose relay was lost) does not run that group again; named in a new round, the same
        # members run it afresh at once.
        rounds = [self._round(stage, batch_steps[stage]) for stage in range(len(self.records))]
        # The furthest step a replica of each stage answered at just now: a replica behind it with no group of its
        # step loads its peers' state at once (CloseBatchRequest.stage_step).
        furthest = [0] * len(self.records)
        for (stage, record), ok in zip(targets, answered):
            if ok is True:
                step = self._polled_steps.get((stage, record.peer_id), 0)
                furthest[stage] = max(furthest[stage], step)

        async def close(stage: int, record: StageRecord) -> None:
            try:
                reply = await self.clients.get(PeerAddress.of(record)).close_batch(
                    self.run_id,
                    stage,
                    batch_steps[stage],
                    live[stage],
                    CLOSE_BATCH_TIMEOUT_S + wait_for_step_s,
                    wait_for_step_s=wait_for_step_s,
                    group=groups[stage],
                    group_round=rounds[stage],
                    stage_step=furthest[stage],
                )
            except SwarmError as e:
                logger.debug("stage %d peer %s: closing batch failed: %s", stage, record.peer_id, e)
                return
            if reply.retry_round > self._round(stage, batch_steps[stage]):
                self._rounds[stage] = (batch_steps[stage], reply.retry_round)
            self.replied(stage, reply.step, record.peer_id)

        await asyncio.gather(
            *(close(*target) for target, ok in zip(targets, answered) if ok is True)
        )

    def closed_soundly(self, stage: int, batch_step: int) -> bool:
        """Whether a close of ``stage``'s batch ``batch_step`` (or a later one) found every replica it asked answering
        at that step and named them all in the group: the stage is taking that step, barring a fault from now on
        (see Trainer._stages_caught_up)."""
        return self._sound.get(stage, -1) >= batch_step

    def _round(self, stage: int, batch_step: int | None) -> int:
        step, round = self._rounds.get(stage, (None, 0))
        return round if step == batch_step else 0

    def _unlisted_holders(self, batch_steps: list[int | None]) -> list[tuple[int, StageRecord]]:
        """Replicas that counted microbatches of the batch being closed (the holdings say so) but whose records are
        not listed now, at the address of their last record. On a loaded machine a live replica's record expires
        between its heartbeats: left out of the count, the group its peers were told to expect assembled without
        it and its samples of the batch were lost (bench/soak.py). Asked like the others, it is counted if it
        answers, and found gone (its part computed again) if its address refuses."""
        if self.holdings is None or not self.holdings.enabled:
            return []
        out = []
        for stage, batch_step in enumerate(batch_steps):
            if batch_step is None:
                continue
            for peer in self.holdings.holders(stage, batch_step) - set(self.records[stage]):
                record = self._last_records.get((stage, peer))
                if record is not None and peer not in self._gone:
                    out.append((stage, record))
        return out

    def _forget_unheld_records(self) -> None:
        """Keep the last records of the replicas listed now or holding microbatches of this trainer (all that
        ``_unlisted_holders`` can ask): in a long run, peers come and go by the hundred."""
        held = (
            [self.holdings.peers(stage) for stage in range(len(self.records))]
            if self.holdings is not None and self.holdings.enabled
            else [set() for _ in self.records]
        )
        self._last_records = {
            (stage, peer): record
            for (stage, peer), record in self._last_records.items()
            if peer in self.records[stage] or peer in held[stage]
        }

    def _one_left(self, stage: int) -> bool:
        """Whether a replica this trainer saw in ``stage`` is known to have left it: its address refused (the process
        is gone), it announces another stage now (moved), or it was seen draining and its record is gone."""
        for k, peer in self._polled_steps:
            if k != stage or peer in self.records[stage]:
                continue
            if (
                peer in self._gone
                or (stage, peer) in self._draining
                or any(peer in self.records[j] for j in range(len(self.records)) if j != stage)
            ):
                return True
        return False

    def _saw_step(self, stage: int, record: StageRecord, info) -> bool:
        """The replica of ``record`` (of ``stage``) answered ``Info`` from the address it announces: note its step.
        False if the answer is not of a replica of ``stage`` (another peer at that address, or one that moved to
        another stage, or is between stages)."""
        if (
            info.peer_id != record.peer_id
            or info.stage != stage
            or info.state == PeerState.STARTING
        ):
            return False
        key = (stage, record.peer_id)
        self._polled_steps[key] = max(self._polled_steps.get(key, 0), info.step)
        self._makers[key] = (
            info.step,
            {s.step: frozenset(s.members) for s in info.averaged_steps},
        )
        self.answered[key] = time.monotonic()
        if info.state == PeerState.SERVING:
            self._draining.discard(key)  # back (a restarted replica keeps its id)
        return True

    def _peer_step(self, stage: int, peer: str) -> int:
        """The optimizer step this trainer last saw ``peer`` of ``stage`` at (its record, its Info)."""
        record = self.records[stage].get(peer)
        return max(
            record.step if record is not None else 0, self._polled_steps.get((stage, peer), 0)
        )

    def _left_out(
        self, stage: int, live: list[str], stage_step: int, batch_step: int, peer: str
    ) -> bool:
        """Whether the steps ``stage`` has taken since batch ``batch_step`` (it stands at ``stage_step``) are known,
        from the Info its ``live`` replicas just gave, to have been taken without ``peer``'s gradients: a live
        replica at ``stage_step`` says whose gradients each of those steps averaged, and no live replica names
        ``peer`` among them (nor in a later step: a replica that missed a step hands its samples over into its next
        one). Then what ``peer`` held of that batch left with it, unapplied. Not known (a step taken some other
        way, taken on part of an all-reduce, or not listed), it may have taken part: False."""
        told = [self._makers.get((stage, p), (0, {})) for p in live]
        if any(
            peer in members for _, steps in told for s, members in steps.items() if s >= batch_step
        ):
            return False
        return any(
            at >= stage_step and all(s in steps for s in range(batch_step, at))
            for at, steps in told
        )

    async def _redo_for_gone(
        self,
        batch_steps: list[int | None],
        gone: list[tuple[int, StageRecord]],
        live: list[tuple[int, StageRecord]],
    ) -> None:
        """Before a batch closes: the gradients that replicas now gone (their address refuses connections, and they
        were not draining: a draining replica hands its in) counted toward batches no live replica of their stage
        (``live``, whose steps their Info just gave) has stepped on left with them; compute them again at live
        replicas, so the stage's step still averages the whole batch (see swarm.trainer.holdings). Forget those of
        batches every replica that held them has stepped on."""
        holdings = self.holdings
        for stage in range(len(self.records)):
            holdings.prune(stage, lambda peer, stage=stage: self._peer_step(stage, peer))
        for stage in sorted({stage for stage, _ in gone}):
            live_steps = [self._peer_step(stage, r.peer_id) for s, r in live if s == stage]
            if batch_steps[stage] is None or not live_steps:
                continue
            left = {r.peer_id for s, r in gone if s == stage and r.state != PeerState.DRAINING}
            live_peers = [r.peer_id for s, r in live if s == stage]
            stage_step = max(live_steps)
            try:
                await holdings.redo(
                    stage,
                    left,
                    from_step=stage_step,
                    left_out=functools.partial(self._left_out, stage, live_peers, stage_step),
                )
            except SwarmError as e:
                logger.warning(
                    "stage %d: computing again the gradients of a replica that left failed (%s); its stage "
                    "steps without them",
                    stage,
                    e,
                )
