"""Sends microbatches through the stages: forward chain, loss at the last stage, backward in reverse.

Every remote call goes through one retry helper (:meth:`Pipeline._call`): it picks a peer with the
routing policy, applies the peer's deadline, retries transport failures at another peer of the same stage
with a finite budget, bans failed peers, and never retries a request the peer rejected as invalid.
Backward goes first to the peer that ran the forward (it holds the inputs or the graph, so only the
output gradient travels); if that peer is gone or no longer has them, another peer gets the inputs too
and recomputes, so no microbatch is lost to a failed peer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable

import torch

from swarm.compression import get_codec
from swarm.config import RunConfig
from swarm.discovery.banreports import BanReport
from swarm.discovery.dht import RunDirectory
from swarm.discovery.records import StageRecord
from swarm.errors import (
    BadReply,
    GradientOutlier,
    InvalidRequest,
    StageUnavailable,
    StepPending,
    SwarmError,
    UsageError,
)
from swarm.routing import Failure, NoPeersAvailable, Router, RoutingConfig, StageRequest, wake_at
from swarm.routing.retry import failure_kind
from swarm.states import PeerState
from swarm.trainer.calls import StageCalls
from swarm.trainer.commits import Outcome, asked_where_it_is, commit_outcome
from swarm.trainer.config import PipelineConfig
from swarm.trainer.gradwatch import GradientWatch
from swarm.trainer.holdings import Holdings
from swarm.trainer.peerlists import PeerLists
from swarm.trainer.push import PushChains
from swarm.trainer.reports import ReportBook
from swarm.trainer.spotcheck import CheckedCall, SpotChecker
from swarm.trainer.stagesteps import StageSteps
from swarm.trainer.work import BACKWARD_COST, FORWARD_COST, MicrobatchResult
from swarm.transport.callers import caller_token
from swarm.transport.client import ClientPool, PeerClient, Reply
from swarm.transport.security import PeerAddress

logger = logging.getLogger(__name__)

# How many times the trainer computes one stage's gradient of a microbatch before it gives up on it.
MAX_RECOMPUTES = 8
# A call refused as pinned to a step its replica has not taken yet (StepPending) is sent again once news of the
# stage's steps comes, or after this many seconds,
STEP_PENDING_RECHECK_S = 0.5
# uncharged to its retry budget for this long
STEP_PENDING_LIMIT_S = 120.0


class Pipeline(PeerLists):
    """Routes calls for one run. Owns the peer lists (refreshed from the DHT) and one channel per peer."""

    def __init__(
        self,
        directory: RunDirectory,
        run: RunConfig,
        *,
        config: PipelineConfig = PipelineConfig(),
        routing: RoutingConfig = RoutingConfig(),
        seed: int = 0,
    ):
        self.directory = directory
        self.run = run
        self.config = config
        self.num_stages = run.model.num_stages
        self.codec = get_codec(run.codec)  # activations
        # gradients: the trainer sends them in it, and asks for them in it (a request's codec is its reply's)
        self.grad_codec = get_codec(run.gradient_codec)
        self.router = Router(routing)
        self.rng = random.Random(seed)
        # every call signed with the trainer's DHT identity (see swarm.transport.callers)
        self.clients = ClientPool(
            segment_bytes=config.segment_bytes, token=caller_token(directory.identity)
        )
        # every record seen recently, draining ones included (backward may still go there)
        self.records: list[dict[str, StageRecord]] = [{} for _ in range(self.num_stages)]
        # peers that announce themselves relayed (behind NAT), already logged: this trainer dials only direct ones
        self._unreachable: set[str] = set()
        # where each stage's optimizer stands, and closing global batches at the stages
        # where the gradients of batches the stages have not stepped on lie, to compute again those of a replica
        # that leaves before its stage steps
        self.holdings = Holdings(self.num_stages)
        self.steps = StageSteps(
            self.records,
            self.clients,
            directory.run_id,
            holdings=self.holdings,
        )
        # (stage, peer) -> when a reply said "draining"; trusted until the DHT catches up
        self._draining_replies: dict[tuple[int, str], float] = {}
        self.failed_calls = 0
        # gradients whose commit outcome stayed unknown (the peer unreachable past its hold; see
        # swarm.trainer.commits), and gradients computed again because a peer did not count them
        self.unconfirmed_commits = 0
        self.recomputed_gradients = 0
        # gradients a stage refused as outliers (swarm.outliers), and microbatches that therefore did not count at
        # that stage and the ones before it (see _gradient_refused)
        self.refused_gradients = 0
        self.lost_gradients = 0
        # peers banned for the rest of the run for a bad reply (wrong shape or dtype, non-finite values, output
        # the next stage refused): routing never picks them again
        self.banned_for_run: set[str] = set()
        self.spot_checks = SpotChecker(
            self,
            share=config.spot_check_share,
            tolerance=config.spot_check_tolerance,
            rng=random.Random(f"spot-checks {seed}"),
        )
        # signed ban reports: published for this trainer's bans, read for others' (swarm.trainer.reports)
        self.reports = ReportBook(
            directory, quorum=config.ban_report_quorum, ttl_s=config.ban_report_ttl_s
        )
        self.gradients = GradientWatch(self.num_stages, max_ratio=config.max_gradient_ratio)
        self.calls = StageCalls(
            directory.run_id,
            run,
            self.records,
            self.clients,
            codec=self.codec,
            grad_codec=self.grad_codec,
            gradients=self.gradients,
        )
        if config.activations == "push" and any(
            run.model.takes_tokens(s) for s in range(self.num_stages)
        ):
            raise UsageError(
                "--activations push does not carry the token ids a subspace cut's stages take; train this "
                "run with --activations relayed"
            )
        self.push = PushChains(self)  # push mode's microbatches (swarm.trainer.push)
        self._refreshed = asyncio.Event()
        self._refresh_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ peers

    async def start(self) -> None:
        await self.refresh()
        self._refresh_task = asyncio.create_task(self._refresh_loop(), name="peer-refresh")

    async def close(self) -> None:
        await self.spot_checks.close()
        await self.reports.close()
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.gather(self._refresh_task, return_exceptions=True)
        await self.clients.close()

    @property
    def run_id(self) -> str:
        return self.directory.run_id

    # ------------------------------------------------------------------ one microbatch

    async def train_microbatch(
        self,
        microbatch_id: str,
        tokens: torch.Tensor,
        batch_steps: list[int] | None = None,
        params_steps: list[int] | None = None,
        on_settled: Callable[[int], None] | None = None,
    ) -> MicrobatchResult:
        """Forward and backward of one microbatch of int64 (B, T+1) windows; returns its mean loss.
        ``batch_steps[k]``: the optimizer step of stage k whose global batch this microbatch belongs to;
        ``params_steps[k]``: the step whose parameters stage k computes it with (None: each replica's current).
        ``on_settled(k)``: called as soon as stage k's gradient of it is counted (a later stage's comes first, while
        the earlier stages still compute theirs), so the trainer can close a stage's batch before the others'.
        In push mode a microbatch sampled for spot-checks (or with peers others reported in the run) goes relayed,
        every stage of it checked: only the relayed path sees the activations."""
        check_all = False
        if self.config.activations == "push":
            check_all = bool(self.reports.suspects) or self.spot_checks.sampled()
            if not check_all:
                return await self.push.train(microbatch_id, tokens, batch_steps)
        x, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T) each
        samples = x.shape[0]
        failures_before = self.failed_calls
        stage_inputs: list[torch.Tensor] = []
        forward_peers: list[str] = []
        last = self.num_stages - 1
        tags = batch_steps or [None] * self.num_stages
        pins = params_steps or [None] * self.num_stages
        cost = samples * (FORWARD_COST + BACKWARD_COST)
        h, stage, suspect = x, 0, None
        while True:
            del stage_inputs[stage:], forward_peers[stage:]
            stage_inputs.append(h)
            try:
                if stage < last:
                    attempt = self.calls.forward(
                        stage, microbatch_id, h, tokens=x, params_step=pins[stage]
                    )
                    reply, peer = await self._call(stage, samples * FORWARD_COST, attempt)
                else:
                    attempt = self.calls.forward(
                        last,
                        microbatch_id,
                        h,
                        tokens=x,
                        targets=targets,
                        batch_step=tags[last],
                        params_step=pins[last],
                    )
                    reply, peer = await self._call(last, cost, attempt)
            except InvalidRequest as e:
                # Stage k refused its input. The trainer's own tokens are checked; an activation came from a
                # peer of stage k - 1: ask another peer of that stage once, and if the call then passes, the
                # first one sent something wrong (banned for the run). Refused again, the request is wrong.
                others = (
                    set(self.router.peers(stage - 1)) - {forward_peers[stage - 1]} if stage else ()
                )
                if stage == 0 or suspect is not None or not others:
                    if suspect is not None:
                        self._unban(suspect)
                    raise
                suspect = forward_peers[stage - 1]
                self._ban_for_run(stage - 1, suspect, e, f"stage {stage} refused its output")
                stage -= 1
                h = stage_inputs[stage]
                continue
            forward_peers.append(peer)
            self._spot_check(
                stage,
                peer,
                reply,
                h,
                x,
                targets if stage == last else None,
                pinned=pins[stage],
                force=check_all,
            )
            if stage == last:
                break
            h = _tensor(reply, "output", peer)
            stage += 1
        # Each stage's commit settles in the background as soon as its gradient call answers (one round trip,
        # overlapped with the rest of the backward pass); once counted, the trainer holds what it takes to compute
        # it again (swarm.trainer.holdings) and ``on_settled`` hears that the stage is done with this microbatch.
        settling: list[asyncio.Future] = []

        async def settle(stage: int, reply: Reply, peer: str, recompute) -> None:
            counted_at = await self._settle(microbatch_id, stage, reply, peer, recompute)
            self.holdings.add(
                stage,
                tags[stage],
                counted_at,
                microbatch_id,
                functools.partial(self._redo, microbatch_id, stage, recompute),
            )
            if on_settled is not None:
                on_settled(stage)

        try:
            settling.append(
                asyncio.ensure_future(
                    settle(last, reply, peer, functools.partial(self._call, last, cost, attempt))
                )
            )
            loss = reply.meta.loss
            grad = reply.tensors.get("grad_input")
            for stage in reversed(range(self.num_stages - 1)):
                if grad is None:
                    raise SwarmError(
                        f"stage {stage + 1} returned no input gradient for microbatch {microbatch_id}"
                    )
                attempt = self.calls.backward(
                    stage,
                    microbatch_id,
                    grad,
                    stage_inputs[stage],
                    x,
                    forward_peers[stage],
                    tags[stage],
                    pins[stage],
                )
                cost = samples * BACKWARD_COST
                # Computed again, it is a backward with the inputs (no peer keeps them after a backward): the peer
                # recomputes the forward too.
                with_inputs = self.calls.backward_with_inputs(
                    stage, microbatch_id, grad, stage_inputs[stage], x, tags[stage], pins[stage]
                )
                recompute = functools.partial(
                    self._call, stage, samples * (FORWARD_COST + BACKWARD_COST), with_inputs
                )
                try:
                    reply, peer = await self._call(
                        stage, cost, attempt, preferred=forward_peers[stage]
                    )
                except GradientOutlier as e:
                    # (``peer``: the one of the stage after, whose gradient this stage refused)
                    second = await self._gradient_refused(
                        stage, microbatch_id, e, peer, samples, with_inputs
                    )
                    if second is None:
                        break  # this microbatch counts at the stages after this one only
                    reply, peer = second
                settling.append(asyncio.ensure_future(settle(stage, reply, peer, recompute)))
                grad = reply.tensors.get("grad_input")
        except BaseException:
            for future in settling:
                future.cancel()
            await asyncio.gather(*settling, return_exceptions=True)
            raise
        settled = await asyncio.gather(*settling, return_exceptions=True)
        if errors := [e for e in settled if isinstance(e, BaseException)]:
            raise errors[0]
        return MicrobatchResult(
            loss=loss,
            samples=samples,
            tokens=targets.numel(),
            attempts_failed=self.failed_calls - failures_before,
        )

    async def _redo(
        self, microbatch_id: str, stage: int, recompute: Callable[[], Awaitable[tuple[Reply, str]]]
    ) -> str:
        """Compute a gradient of ``stage`` again (its replica left with it before the stage stepped) and make sure
        it counts once; returns the peer that counted it (see swarm.trainer.holdings)."""
        reply, peer = await recompute()
        return await self._settle(microbatch_id, stage, reply, peer, recompute)

    async def _settle(
        self,
        microbatch_id: str,
        stage: int,
        reply: Reply,
        peer: str,
        recompute: Callable[[], Awaitable[tuple[Reply, str]]],
    ) -> str:
        """Make sure ``stage`` counts this microbatch's gradient exactly once (returns the peer that counted it):
        wait for the commit's outcome
        (one round trip after the reply, overlapped with the rest of the backward pass), and compute the
        gradient again, at most ``MAX_RECOMPUTES`` times, when the peer did not count it."""
        computations = 1
        while True:
            outcome = await commit_outcome(self._asked_where_it_is(stage, peer, reply))
            if outcome is Outcome.APPLIED:
                return peer
            if outcome is Outcome.UNKNOWN:
                self.unconfirmed_commits += 1
            if computations > MAX_RECOMPUTES:
                raise SwarmError(
                    f"stage {stage} did not count the gradients of microbatch {microbatch_id} computed "
                    f"{computations} times; is the peers' --commit-hold-s shorter than a reply's transfer?"
                )
            self.recomputed_gradients += 1
            logger.warning(
                "stage %d %s the gradients of microbatch %s; computing them again",
                stage,
                "did not count"
                if outcome is Outcome.DROPPED
                else "could not be asked whether it counted",
                microbatch_id,
            )
            reply, peer = await recompute()
            computations += 1

    def _asked_where_it_is(self, stage: int, peer: str, reply: Reply) -> Reply:
        """``reply``, its commit asked again at the address of ``peer``'s newest record (see the commits module)."""

        def client_now() -> PeerClient | None:
            record = self.records[stage].get(peer)
            return None if record is None else self.clients.get(PeerAddress.of(record))

        def own_address() -> bool:
            """Whether its newest record names its own address, not a relay's (nor none: its record expired)."""
            record = self.records[stage].get(peer)
            return record is not None and not record.relay_peer_id

        return asked_where_it_is(reply, client_now, own_address=own_address)

    async def _gradient_refused(
        self,
        stage: int,
        microbatch_id: str,
        refusal: GradientOutlier,
        sender: str,
        samples: int,
        with_inputs: Callable[[PeerAddress, float], Awaitable[Reply]],
    ) -> tuple[Reply, str] | None:
        """A replica of ``stage`` refused the gradient that ``sender`` (a peer of the next stage) sent back, as far
        larger than the stage's recent ones. Nothing was counted there; the stages after it have counted theirs,
        so the microbatch cannot be computed again from the start. A second replica decides: if it accepts the
        gradient, its reply and peer are returned (the first replica's history was the odd one). If it refuses
        too, the sender is banned for the run (no report: the input the gradient came with could be the bad
        part). Refused twice, or with no other replica to ask, the microbatch does not count at this stage and
        the ones before it (None), and the trainer says so; training goes on."""
        self.refused_gradients += 1
        try:
            other = self.router.choose(
                stage, time.monotonic(), self.rng, exclude={refusal.peer} - {None}
            )
        except NoPeersAvailable:
            other = None
        if other is not None:
            record = self.records[stage][other]
            timeout_s = self.call_timeout_s(stage, record, samples * (FORWARD_COST + BACKWARD_COST))
            try:
                reply = await with_inputs(PeerAddress.of(record), timeout_s)
                self.steps.replied(stage, reply.meta.step, other)
                return reply, other
            except GradientOutlier as e:
                self._ban_for_run(
                    stage + 1,
                    sender,
                    e,
                    f"two replicas of stage {stage} refused the gradient it sent",
                )
            except SwarmError as e:
                logger.info(
                    "stage %d peer %s: no second opinion on a refused gradient: %s", stage, other, e
                )
        self.lost_gradients += 1
        logger.warning(
            "microbatch %s counts at stages %d+ only: stage %d refused the gradient peer %s sent (%s)",
            microbatch_id,
            stage + 1,
            stage,
            sender,
            refusal,
        )
        return None

    async def eval_microbatch(self, tokens: torch.Tensor) -> float:
        """Validation loss of one batch: forward only, nothing kept or accumulated by the peers."""
        x, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        h, samples = x, x.shape[0]
        for stage in range(self.num_stages):
            is_last = stage == self.num_stages - 1
            reply, peer = await self._call(
                stage,
                samples * FORWARD_COST,
                self.calls.forward(
                    stage,
                    "eval",
                    h,
                    tokens=x,
                    targets=targets if is_last else None,
                    eval_only=True,
                ),
            )
            self._spot_check(stage, peer, reply, h, x, targets if is_last else None)
            if is_last:
                return reply.meta.loss
            h = _tensor(reply, "output", peer)
        raise AssertionError("unreachable")

    def _spot_check(
        self,
        stage: int,
        peer: str,
        reply: Reply,
        h: torch.Tensor,
        tokens: torch.Tensor,
        targets: torch.Tensor | None,
        *,
        pinned: int | None = None,
        force: bool = False,
    ) -> None:
        """Maybe (``force``: surely) have another replica of ``stage`` recompute this forward (its output, or at
        the last stage its loss) and compare: see :mod:`swarm.trainer.spotcheck`. A call ``pinned`` to a step's
        parameters is recomputed on the parameters of the step it ran on."""
        # a peer others reported (too few to avoid it) is checked on every call: see swarm.trainer.reports
        if not force and not self.spot_checks.sampled() and peer not in self.reports.suspects:
            return
        if stage == self.num_stages - 1:
            result = torch.tensor([reply.meta.loss])
        else:
            result = reply.tensors["output"]
        check = self.calls.forward(
            stage,
            "spot-check",
            h,
            tokens=tokens,
            targets=targets,
            eval_only=True,
            params_step=None if pinned is None else _params_step(reply),
        )

        async def recompute(address: PeerAddress, timeout_s: float):
            answer = await check(address, timeout_s)
            version = (_params_step(answer), answer.meta.param_digest)
            if targets is not None:
                return version, torch.tensor([answer.meta.loss])
            return version, answer.tensors["output"]

        version = (_params_step(reply), reply.meta.param_digest)
        work = h.shape[0] * FORWARD_COST
        self.spot_checks.check(CheckedCall(stage, peer, version, result, recompute, work))

    # ------------------------------------------------------------------ the one retry helper

    def call_timeout_s(self, stage: int, record: StageRecord, work: float) -> float:
        """The deadline of a call of ``work`` forward-sample units to the peer of ``record``: the router's
        estimate, plus twice the pause the peer announces for its optimizer step (the call may land while its stage
        steps: the all-reduce)."""
        return self.router.deadline_s(stage, record.peer_id, work) + 2 * record.step_pause_s

    async def _call(
        self,
        stage: int,
        work: float,
        attempt: Callable[[PeerAddress, float], Awaitable[Reply]],
        *,
        preferred: str | None = None,
    ) -> tuple[Reply, str]:
        """Run ``attempt(address, timeout_s)`` against a peer of ``stage`` until it succeeds, retrying
        transport failures at other peers within the routing policy's finite budget. ``work`` is the call's
        size in forward-sample units, so the routing estimates and deadlines fit every kind of call."""
        request = StageRequest(self.router, stage, preferred=preferred)
        pending_since: float | None = None
        while True:
            peer = await self._choose(request)
            record = self.records[stage][peer]
            timeout_s = self.call_timeout_s(stage, record, work)
            started = time.monotonic()
            self.router.on_start(stage, peer, started)
            try:
                reply = await attempt(PeerAddress.of(record), timeout_s)
            except StepPending as e:
                # The replica has not taken the step the call is pinned to yet (sent before this trainer heard of
                # it): no fault, nothing computed. Wait for news of the stage's steps and send it again, uncharged,
                # for up to STEP_PENDING_LIMIT_S; past that it counts as a failure like any other.
                now = time.monotonic()
                self.router.on_cancel(stage, peer, now)
                pending_since = now if pending_since is None else pending_since
                if now - pending_since > STEP_PENDING_LIMIT_S:
                    self._failed(request, stage, peer, e)
                    continue
                await self.steps.news(STEP_PENDING_RECHECK_S)
                continue
            except SwarmError as e:
                self._failed(request, stage, peer, e)  # raises when the budget is spent
                continue
            except BaseException:
                self.router.on_cancel(stage, peer, time.monotonic())
                raise
            now = time.monotonic()
            # compute_s: the peer's own compute time for the call (0 from a peer that does not report it)
            self.router.on_success(
                stage, peer, work, max(now - started, 1e-6), now, reply.meta.compute_s or None
            )
            self.steps.replied(stage, reply.meta.step, peer)
            if (
                reply.meta.state == PeerState.DRAINING
                and (stage, peer) not in self._draining_replies
            ):
                self._draining_replies[(stage, peer)] = now
                self._update_router(stage, now)
            return reply, peer

    def _failed(
        self,
        request: StageRequest,
        stage: int,
        peer: str,
        error: SwarmError,
        *,
        reported: bool = False,
    ) -> None:
        """A call to ``peer`` of ``stage`` failed with ``error``: count it, mark a peer that is leaving, ban one
        that sent a bad reply (for the run when this trainer saw the reply itself; ``reported``: another peer saw
        it, a push hop, so only with back-off), and charge the request's budget. Raises ``error`` when retrying
        elsewhere cannot help, RetriesExhausted when the budget is spent."""
        now = time.monotonic()
        kind = failure_kind(error)
        if kind is not Failure.GIVE_UP:
            self.failed_calls += 1
            # A shed call is routine under load (the peer was busy, not faulty): not worth a line each.
            logger.log(
                logging.DEBUG if kind is Failure.SHED else logging.INFO,
                "stage %d peer %s failed (%s: %s); retrying elsewhere",
                stage,
                peer,
                type(error).__name__,
                error,
            )
        if kind is Failure.AVOID:
            # Alive and honest: it is leaving or moved to another stage. Not banned (it may come back, e.g.
            # moved to this stage later); no new work here until the DHT says otherwise.
            self._draining_replies[(stage, peer)] = now
            self._update_router(stage, now)
        if isinstance(error, BadReply) and not reported:
            self._ban_for_run(
                stage, peer, error, "its reply failed the checks", report={"kind": "bad_reply"}
            )
        # raises RetriesExhausted naming the stage when the budget is spent
        request.failed(peer, error, now)
        if kind is Failure.GIVE_UP:
            error.peer = peer
            raise error

    def _ban_for_run(
        self, stage: int, peer: str, error: SwarmError, why: str, *, report: dict | None = None
    ) -> None:
        """Never route to ``peer`` again in this run (logged once per peer). A proven fault comes with
        ``report`` (BanReport fields: its kind and evidence), published for the other trainers."""
        if peer in self.banned_for_run:
            return
        self.banned_for_run.add(peer)
        logger.warning(
            "stage %d peer %s banned for the rest of the run: %s (%s)", stage, peer, why, error
        )
        if report is not None and self.directory.identity is not None:
            self.reports.report(
                BanReport.make(
                    peer_id=peer,
                    run_id=self.run_id,
                    stage=stage,
                    reason=f"{why}: {error}",
                    **report,
                )
            )
        self._update_router(stage, time.monotonic())

    def _unban(self, peer: str) -> None:
        """Lift a run ban that a second opinion did not confirm."""
        self.banned_for_run.discard(peer)
        logger.warning(
            "peer %s is routed again: another peer's output was refused the same way", peer
        )
        for stage in range(self.num_stages):
            self._update_router(stage, time.monotonic())

    async def _choose(self, request: StageRequest) -> str:
        """A peer for ``request``; when none is eligible, wait (bounded) for one to appear or a ban to end."""
        stage = request.stage
        deadline = time.monotonic() + self.config.empty_stage_wait_s
        warned = False
        while True:
            now = time.monotonic()
            try:
                # Backward may still go to the forward's peer while it drains: the records keep draining peers.
                return request.choose(
                    now, self.rng, preferred_known=request.preferred in self.records[stage]
                )
            except NoPeersAvailable as e:
                if now > deadline:
                    raise StageUnavailable(
                        f"stage {stage} of run '{self.run_id}' has had no live peer for "
                        f"{self.config.empty_stage_wait_s:.0f}s ({e}); start a peer with "
                        f"`swarm peer --run-id {self.run_id} --stage {stage}`"
                    ) from None
                if not warned:
                    logger.warning(
                        "stage %d has no live peer right now (%s); waiting up to %.0fs",
                        stage,
                        e,
                        self.config.empty_stage_wait_s,
                    )
                    warned = True
                wake = wake_at(
                    e, now, wait_s=min(deadline - now, self.config.refresh_s * 2), min_wait_s=0.05
                )
                await self._next_refresh(timeout_s=wake - now)


def _params_step(reply: Reply) -> int:
    """The optimizer step whose parameters ``reply`` was computed with."""
    meta = reply.meta
    return meta.params_step if meta.HasField("params_step") else meta.step


def _tensor(reply: Reply, name: str, peer: str) -> torch.Tensor:
    if name not in reply.tensors:
        raise SwarmError(f"peer {peer} replied without the '{name}' tensor")
    return reply.tensors[name]
