"""The StagePeer gRPC servicer: validates every request, runs compute on the peer's worker thread.

It sees the peer only through a :class:`ServiceContext` (ids, state, admission, the executor, the compute
thread): it never imports the peer's lifecycle, so the lifecycle can build it without an import circle.

Validation order matters for "bad input loses nothing": the request header (protocol, run, stage, codec,
state) is checked first, tensor headers are checked before their payload is received, payloads are
checked while decoding (lengths, finiteness), and only then does the executor touch any state.

Bounds (docs/security.md, "Bounded resources"): every streaming call is admitted by :class:`CallLimits`
(streams per caller, request memory reserved from the tensor headers, whose every dimension is checked
against this stage of the run's model first), reads its request under :class:`DeadlineFrames`' deadlines, and
queues for the compute thread only while fewer than ``max_queued_calls`` calls do, and only when its caller's
deadline can still be met (:class:`WorkQueue`, load shedding).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from swarm.averaging.direct import Group
from swarm.compression import CODEC_NAMES
from swarm.compression.base import all_finite
from swarm.deadline import timeout
from swarm.errors import (
    InvalidRequest,
    StepPending,
    StreamTimeout,
    SwarmError,
    TransportError,
    WrongPeer,
)
from swarm.model.subspace import token_wire_dtype
from swarm.peer.admission import Admission
from swarm.peer.config import LimitsConfig
from swarm.peer.executor import StageExecutor
from swarm.peer.limits import CallLimits, Reservation, caller_address
from swarm.peer.push import PushHops, check_route, serve_push
from swarm.peer.queue import WorkQueue
from swarm.peer.reachability import DialBacks
from swarm.peer.stepwatch import StepWatch
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.proto import swarm_pb2_grpc as pb_grpc
from swarm.states import PeerState
from swarm.transport.callers import caller_peer_id
from swarm.transport.channel import WORK_TIMEOUT_KEY
from swarm.transport.server import DeadlineFrames, stream_handler, unary_handler
from swarm.transport.tensors import FrameReader, StreamLimits, codec_or_invalid, tensor_frames

logger = logging.getLogger(__name__)

# The longest a CloseBatch may wait for this replica's step before it answers (a trainer asks for less).
MAX_CLOSE_WAIT_S = 30.0
# How long a call pinned to the step this replica is about to take waits for it (see _at_pinned_step)
PINNED_STEP_WAIT_S = 2.0


@dataclass(frozen=True, kw_only=True)
class ServiceContext:
    """What the service needs from the peer that runs it."""

    run_id: str  # the run this peer serves
    peer_id: str
    state: Callable[[], PeerState]  # the peer's state now (sent in every reply)
    # read on every call: a peer that moves swaps its executor
    executor: Callable[[], StageExecutor]
    admission: Admission  # drain window, fault injection, in-flight count
    max_microbatch_size: int  # most samples accepted in one request
    # run fn(*args, **kwargs) on the compute thread, after queued work
    compute: Callable[..., Awaitable[Any]]
    # run a cheap fn(*args) there ahead of queued compute
    compute_urgent: Callable[..., Awaitable[Any]]
    submit_urgent: Callable[..., None]  # queue a cheap fn(*args) ahead of compute, without waiting
    limits: LimitsConfig = LimitsConfig()  # memory, streams, queue and read deadlines
    push: PushHops | None = (
        None  # calls the next stage of push calls (None: push calls are refused)
    )
    # the replica's optimizer step, for a CloseBatch that waits for it (None: the peer does not average, and its
    # step does not follow the trainer's batches: a close is answered at once)
    steps: StepWatch | None = None


class StageService(pb_grpc.StagePeerServicer):
    def __init__(self, context: ServiceContext):
        self.ctx = context
        self.limits = StreamLimits()
        self.calls = CallLimits(context.limits)
        self.queue = WorkQueue(
            max_queue_wait_s=context.limits.max_queue_wait_s,
            enabled=context.limits.shed_late_work,
        )
        self.dial_backs = DialBacks(context.run_id, timeout_s=context.limits.dial_back_timeout_s)
        # commits answered through the Commit RPC (the in-call one, or a push call's first, was not confirmed)
        self.late_commits = 0
        # push calls' microbatch ids whose first commit has not come yet (bounded: the oldest go first)
        self._deferred: OrderedDict[str, None] = OrderedDict()
        # called as each call ends: (method, seconds, outcome); see swarm.transport.server
        self.observer: Callable[[str, float, str], None] | None = None

    @property
    def executor(self) -> StageExecutor:
        return self.ctx.executor()

    # ------------------------------------------------------------------ RPCs

    @stream_handler
    async def Forward(self, request_iterator, context) -> AsyncIterator[pb.Frame]:
        with self.calls.call(caller_address(context.peer())) as reservation:
            frames = self._deadlines(request_iterator)
            reader = FrameReader(frames, limits=self.limits)
            deadline_s = _work_deadline(context)
            meta = await reader.request()
            self._check_request(meta)
            async with self.ctx.admission.call(new_work=not meta.eval_only, stage_index=meta.stage):
                codec = codec_or_invalid(meta.codec)
                stage = self.executor.stage_module
                wants_loss = meta.compute_loss or (meta.eval_only and stage.is_last)
                if meta.route:
                    check_route(meta, is_last=stage.is_last)
                names = {"input", "targets"} if wants_loss or meta.route else {"input"}
                tensors = await self._read_tensors(
                    reader, meta, names | _tokens(stage), reservation
                )
                x = _joined_input(stage, tensors)
                work = dict(deadline_s=deadline_s, samples=x.shape[0])
                params_step = _params_step(meta)
                await self._at_pinned_step(params_step, deadline_s)
                if meta.eval_only and stage.is_last:
                    work.update(forward=True, backward=False)
                    loss, version = await self._compute(
                        self._versioned(self.executor.eval_loss, params_step),
                        x,
                        _require(tensors, "targets"),
                        params_step,
                        work=work,
                    )
                    yield self._reply(loss=loss, version=version, compute_s=work["compute_s"])
                elif meta.route:
                    async for frame in serve_push(
                        self, reader, frames, meta, codec, x, _require(tensors, "targets"), work
                    ):
                        yield frame
                elif meta.compute_loss:
                    work.update(forward=True, backward=True)
                    (loss, grad_input), version = await self._compute(
                        self._versioned(self.executor.forward_loss_backward, params_step),
                        meta.microbatch_id,
                        x,
                        _require(tensors, "targets"),
                        _num_samples(meta, x),
                        params_step,
                        work=work,
                    )
                    async for frame in self._reply_and_commit(
                        reader,
                        frames,
                        meta,
                        codec,
                        grad_input,
                        loss=loss,
                        version=version,
                        compute_s=work["compute_s"],
                    ):
                        yield frame
                elif stage.is_last:
                    raise InvalidRequest(
                        "the last stage needs compute_loss (with targets) or eval_only"
                    )
                else:
                    work.update(forward=True, backward=False)
                    output, version = await self._compute(
                        self._versioned(
                            _finite_output(self.executor.forward, stage.index), params_step
                        ),
                        meta.microbatch_id,
                        x,
                        keep=not meta.eval_only,
                        params_step=params_step,
                        work=work,
                    )
                    reply = self._reply(num_tensors=1, version=version, compute_s=work["compute_s"])
                    # checked on the compute thread (_finite_output)
                    sent = tensor_frames("output", output, codec, lead=[reply], known_finite=True)
                    async for frame in sent:
                        yield frame

    @stream_handler
    async def Backward(self, request_iterator, context) -> AsyncIterator[pb.Frame]:
        with self.calls.call(caller_address(context.peer())) as reservation:
            frames = self._deadlines(request_iterator)
            reader = FrameReader(frames, limits=self.limits)
            deadline_s = _work_deadline(context)
            meta = await reader.request()
            self._check_request(meta)
            # A draining peer still finishes backward for microbatches it ran forward for.
            async with self.ctx.admission.call(
                new_work=meta.include_inputs, stage_index=meta.stage
            ):
                codec = codec_or_invalid(meta.codec)
                stage = self.executor.stage_module
                allowed = (
                    {"grad_output", "input"} | _tokens(stage)
                    if meta.include_inputs
                    else {"grad_output"}
                )
                tensors = await self._read_tensors(reader, meta, allowed, reservation)
                grad_output = _require(tensors, "grad_output")
                inputs = _joined_input(stage, tensors) if meta.include_inputs else None
                if inputs is not None:  # (its forward runs here again, on the step it is pinned to)
                    await self._at_pinned_step(_params_step(meta), deadline_s)
                work = dict(
                    deadline_s=deadline_s,
                    samples=grad_output.shape[0],
                    forward=inputs is not None,
                    backward=True,
                )
                grad_input = await self._compute(
                    self.executor.backward,
                    meta.microbatch_id,
                    grad_output,
                    inputs,
                    _num_samples(meta, grad_output),
                    _params_step(meta),
                    work=work,
                )
                async for frame in self._reply_and_commit(
                    reader, frames, meta, codec, grad_input, compute_s=work["compute_s"]
                ):
                    yield frame

    def _deadlines(self, request_iterator) -> DeadlineFrames:
        limits = self.ctx.limits
        return DeadlineFrames(
            request_iterator, idle_s=limits.read_idle_s, total_s=limits.read_total_s
        )

    async def _at_pinned_step(self, params_step: int | None, deadline_s: float | None) -> None:
        """A call pinned to a step this replica has not taken yet waits for it, up to ``PINNED_STEP_WAIT_S`` (and the
        caller's deadline): a trainer in lockstep sends a batch's first microbatches as soon as it has closed the
        batch before, without waiting to hear that every replica stepped on it, and the replica computes them
        the moment its step is done. A step that does not come in time (its all-reduce failed and runs again, its
        trainer closes the batch again): StepPending, and the trainer sends it again once the stage has stepped."""
        if params_step is None or self.executor.step >= params_step:
            return
        wait_s = 0.0  # a replica that does not average has no step under way to wait for
        if self.ctx.steps is not None:
            wait_s = PINNED_STEP_WAIT_S
            if deadline_s is not None:
                # answered before the caller gives up on it, with time left for the reply to travel
                wait_s = max(0.0, min(wait_s, 0.8 * (deadline_s - time.monotonic())))
            await self.ctx.steps.wait_past(params_step - 1, wait_s)
        if self.executor.step < params_step:
            raise StepPending(
                f"this replica is at step {self.executor.step}; the call is pinned to step {params_step}, which "
                f"did not come within {wait_s:.2f}s: send it again once the stage has taken it"
            )

    async def _compute(self, fn, *args, work: dict, **kwargs):
        """Run ``fn`` on the compute thread, counted in flight (the load announced); PeerOverloaded when
        ``max_queued_calls`` calls already wait for it or run there, DeadlineUnmet when the caller's deadline
        cannot be met (see :class:`WorkQueue`). ``work``: ``deadline_s`` (monotonic, or None), ``samples`` and
        the ``forward``/``backward`` flags of :meth:`StageExecutor.predicted_s`. Sets ``work["compute_s"]`` to
        the seconds ``fn`` ran on the compute thread (its wait in the queue excluded), which the reply reports
        (ReplyMeta.compute_s: the caller's routing weighs peers by it, see swarm.routing.Router)."""
        deadline_s, samples = work["deadline_s"], work["samples"]
        cost_s = self.executor.predicted_s(
            samples, forward=work["forward"], backward=work["backward"]
        )
        work["compute_s"] = 0.0

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                work["compute_s"] = time.perf_counter() - started

        with self.ctx.admission.working(max_in_flight=self.ctx.limits.max_queued_calls):
            with self.queue.admit(deadline_s=deadline_s, cost_s=cost_s) as guard:
                return await self.ctx.compute(guard(timed), *args, **kwargs)

    async def _read_tensors(
        self,
        reader: FrameReader,
        meta: pb.RequestMeta,
        allowed: set[str],
        reservation: Reservation,
    ):
        if meta.num_tensors > len(allowed):
            raise InvalidRequest(
                f"the call announces {meta.num_tensors} tensors; at most {len(allowed)} "
                f"({sorted(allowed)}) are expected"
            )
        check = self._header_check(allowed=allowed, reservation=reservation)
        return await reader.tensors(meta.num_tensors, check=check)

    async def _reply_and_commit(
        self,
        reader: FrameReader,
        frames: DeadlineFrames,
        meta: pb.RequestMeta,
        codec,
        grad_input,
        *,
        loss: float | None = None,
        version: tuple[int, str, int | None] | None = None,
        push: dict | None = None,
        compute_s: float = 0.0,
    ) -> AsyncIterator[pb.Frame]:
        """Send the reply (with ``push``: the push fields of ReplyMeta, hops and downstream_s), then wait for the
        caller's commit before counting the gradients (with ``meta.defer_commit`` the call ends after the reply:
        the trainer commits through the Commit RPC). If the call ends before any of the reply was sent, the
        caller cannot commit: the gradients are dropped now (it retries elsewhere). If it ends later, the caller
        may have the reply and commit through the Commit RPC: the gradients stay held until the hold runs out
        (see swarm.peer.ledger). Keeping them is always safe; dropping them early only saves memory, so it is
        done only when the caller surely has nothing."""
        replying = False
        try:
            grad_input = self.executor.stage_module.wire_grad(grad_input)
            reply = self._reply(
                loss=loss,
                num_tensors=int(grad_input is not None),
                hold_s=self.executor.cache_config.commit_hold_s,
                version=version,
                compute_s=compute_s,
            )
            if push:
                reply.reply.hops.extend(push["hops"])
                reply.reply.downstream_s = push["downstream_s"]
            if grad_input is None:
                yield reply
                replying = True
            else:  # the reply frame travels with the tensor's first chunk
                async for frame in tensor_frames("grad_input", grad_input, codec, lead=[reply]):
                    yield frame
                    replying = True
            if meta.defer_commit:
                if meta.discard_gradients:  # computed for the stages before this one only
                    self.ctx.submit_urgent(
                        self.executor.abort, meta.microbatch_id, "the caller asked for no gradient"
                    )
                else:  # held for commit_hold_s: the trainer commits through the Commit RPC
                    _bounded_add(self._deferred, meta.microbatch_id)
                return
            # The commit comes once the caller has read the reply; after the hold it could not count anyway.
            frames.expect_within(self.executor.cache_config.commit_hold_s)
            commit = await reader.commit()
            if commit.microbatch_id != meta.microbatch_id:
                raise InvalidRequest(
                    f"commit names microbatch {commit.microbatch_id!r}, the call was for "
                    f"{meta.microbatch_id!r}"
                )
            batch_step = meta.batch_step if meta.HasField("batch_step") else None
            await self._apply_commit(
                meta.microbatch_id, batch_step, self.ctx.admission.lose_commit()
            )
        finally:
            if not replying:
                self.ctx.submit_urgent(self.executor.abort, meta.microbatch_id)

    async def _apply_commit(self, microbatch_id: str, batch_step: int | None, lose: str | None):
        """Count a held gradient (True: this applied it), or lose the commit as fault injection says (``lose``,
        see Admission.lose_commit)."""
        if lose == "before":
            raise TransportError(
                f"injected fault: the commit of microbatch {microbatch_id} was lost before it was "
                f"applied (--lose-commit-probability); its gradients stay held for the Commit RPC"
            )
        if lose == "late":
            await self.ctx.compute_urgent(
                self.executor.abort, microbatch_id, "injected fault: a commit after the hold"
            )
        applied_now = await self.ctx.compute_urgent(self.executor.commit, microbatch_id, batch_step)
        if lose == "after":
            raise TransportError(
                f"injected fault: the commit of microbatch {microbatch_id} was applied and its "
                f"confirmation lost (--lose-commit-probability)"
            )
        return applied_now

    @unary_handler
    async def Commit(self, request: pb.CommitRequest, context) -> pb.CommitReply:
        """The caller's commit: the first one of a push call's gradients (``defer_commit``), or the commit of a
        call that ended before the peer confirmed it (idempotent). A push call's first commit may be lost as an
        in-call commit may (fault injection), and is not counted late."""
        self._check_request(request)
        first = self._deferred.pop(request.microbatch_id, False) is None
        async with self.ctx.admission.call(new_work=False, stage_index=request.stage):
            batch_step = request.batch_step if request.HasField("batch_step") else None
            lose = self.ctx.admission.lose_commit() if first else None
            applied_now = await self._apply_commit(request.microbatch_id, batch_step, lose)
        if not first:
            self.late_commits += 1
        return pb.CommitReply(applied_now=applied_now, step=self.executor.step)

    @unary_handler
    async def CloseBatch(self, request: pb.CloseBatchRequest, context) -> pb.CloseBatchReply:
        """A trainer's part of global batch ``batch_step`` is all committed: the stage need not wait for more. With
        ``wait_for_step_s``, answered once this replica has stepped past the batch (or that wait is over)."""
        self._check_stage(request)
        wait_s = request.wait_for_step_s
        if not (math.isfinite(wait_s) and 0.0 <= wait_s <= MAX_CLOSE_WAIT_S):
            raise InvalidRequest(
                f"wait_for_step_s must be between 0 and {MAX_CLOSE_WAIT_S:g} seconds, got {wait_s}; a trainer "
                "waits less than its call's deadline"
            )
        group = (
            Group.from_request(request.batch_step, request.group, request.group_round)
            if request.group
            else None
        )
        self.executor.close_batch(
            request.batch_step,
            request.replicas,
            group,
            # (a trainer's word for a step past the batch after next says nothing it could know)
            stage_step=min(request.stage_step, request.batch_step + 1),
        )
        if wait_s > 0 and self.ctx.steps is not None:
            await self.ctx.steps.wait_past(request.batch_step, wait_s)
        return pb.CloseBatchReply(
            step=self.executor.step,
            retry_round=self.executor.optimizer.retry_round(request.batch_step),
        )

    @stream_handler
    async def ReducePart(self, request_iterator, context) -> AsyncIterator[pb.Frame]:
        """A groupmate's share of the part of a step's all-reduce that this replica owns (swarm.averaging.direct);
        answered with the part's average once every member's share is in."""
        with self.calls.call(caller_address(context.peer())) as reservation:
            frames = self._deadlines(request_iterator)
            reader = FrameReader(frames, limits=self.limits)
            meta = await reader.reduce()
            self._check_stage(meta)
            direct = getattr(self.executor.optimizer, "direct", None)
            if direct is None:
                raise WrongPeer(
                    f"this peer does not average stage {meta.stage} directly (it runs without --all-reduce "
                    "direct, or without averaging); its trainer's group should not have named it"
                )
            sender = caller_peer_id(context.invocation_metadata())
            numel = direct.parts.check(meta, sender, direct.numel)

            def check(name: str, shape: tuple[int, ...], dtype: torch.dtype, codec: str) -> None:
                if name != "sums" or shape != (numel,) or dtype != torch.float32 or codec != "none":
                    raise InvalidRequest(
                        f"a share of part {meta.part} is the float32 tensor 'sums' of shape [{numel}] in codec "
                        f"'none', got '{name}' {dtype} of shape {list(shape)} in '{codec}'"
                    )
                reservation.reserve(
                    2 * numel * 4, f"a share of {numel} gradient values and its average"
                )

            share = (await reader.tensors(1, check=check))["sums"]
            await reader.end()
            average = await direct.parts.contribute(
                meta.step, tuple(meta.members), meta.part, sender, share, meta.samples, meta.round
            )
            reply = self._reply(num_tensors=1)
            async for frame in tensor_frames(
                "average", average, codec_or_invalid("none"), lead=[reply], known_finite=True
            ):
                yield frame

    @stream_handler
    async def GetState(self, request: pb.StateRequest, context) -> AsyncIterator[pb.Frame]:
        if request.run_id != self.ctx.run_id:
            raise WrongPeer(f"this peer serves run '{self.ctx.run_id}', not '{request.run_id}'")
        ex = self.executor
        total_s = self.ctx.limits.read_total_s
        with self.calls.call(caller_address(context.peer())) as reservation:
            # The copy lives until the caller has read it all: count it, and give the caller a deadline.
            copies = 2 if request.include_grads else 1
            reservation.reserve(copies * ex.state_bytes, "a copy of the stage's state")

            def take():
                return (
                    ex.step,
                    ex.samples_accumulated,
                    ex.snapshot(include_grads=request.include_grads),
                )

            try:
                async with timeout(total_s):
                    step, samples, tensors = await self.ctx.compute_urgent(take)
                    reply = pb.Frame(
                        reply=pb.ReplyMeta(
                            step=step,
                            state=self.ctx.state(),
                            samples_accumulated=samples,
                            num_tensors=len(tensors),
                        )
                    )
                    codec = codec_or_invalid("none")  # state travels exactly
                    lead = [reply]  # travels with the first tensor's first chunk
                    for name, tensor in tensors.items():
                        async for frame in tensor_frames(name, tensor, codec, lead=lead):
                            yield frame
                        lead = []
                    if lead:
                        yield reply
            except TimeoutError:
                raise StreamTimeout(
                    f"the state was not read within --read-total-s={total_s:g}s; the call is cut"
                ) from None

    @unary_handler
    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        if request.run_id and request.run_id != self.ctx.run_id:
            raise WrongPeer(f"this peer serves run '{self.ctx.run_id}', not '{request.run_id}'")
        ex = self.executor
        step, digest = ex.step_and_digest()
        return pb.InfoResponse(
            protocol_version=PROTOCOL_VERSION,
            run_id=self.ctx.run_id,
            stage=ex.stage_index,
            peer_id=self.ctx.peer_id,
            state=self.ctx.state(),
            throughput=ex.throughput,
            in_flight=self.ctx.admission.in_flight,
            step=step,
            param_digest=digest,
            samples_accumulated=ex.samples_accumulated,
            microbatches_applied=ex.microbatches_applied,
            samples_applied=ex.samples_applied,
            busy_s=ex.busy_s,
            late_commits=self.late_commits,
            gradients_dropped=ex.gradients_dropped,
            samples_left_out=ex.samples_left_out,
            codecs=list(CODEC_NAMES),
            averaged_steps=[
                pb.AveragedStep(step=s, members=members) for s, members in ex.averaged_steps
            ],
        )

    @unary_handler
    async def DialBack(self, request: pb.DialBackRequest, context) -> pb.DialBackReply:
        """A starting peer asks whether it can be dialed at its endpoint (see swarm.peer.reachability)."""
        return await self.dial_backs.answer(request, context.peer())

    # ------------------------------------------------------------------ checks

    def _check_request(self, meta: pb.RequestMeta | pb.CommitRequest) -> None:
        """The request header names this peer's protocol, run and stage, and a usable microbatch id."""
        self._check_stage(meta)
        if not meta.microbatch_id or len(meta.microbatch_id) > 256:
            raise InvalidRequest(
                "microbatch_id must be a non-empty string of at most 256 characters"
            )

    def _check_stage(self, meta: pb.RequestMeta | pb.CommitRequest | pb.CloseBatchRequest) -> None:
        """The request names this peer's protocol, run and stage."""
        if meta.protocol_version != PROTOCOL_VERSION:
            raise InvalidRequest(
                f"protocol version {meta.protocol_version} is not supported by this peer "
                f"(it speaks {PROTOCOL_VERSION}); upgrade the older side"
            )
        if meta.run_id != self.ctx.run_id:
            raise WrongPeer(f"this peer serves run '{self.ctx.run_id}', not '{meta.run_id}'")
        if meta.stage != self.executor.stage_index:
            raise WrongPeer(
                f"this peer serves stage {self.executor.stage_index} of run '{self.ctx.run_id}', "
                f"not stage {meta.stage}; refresh the peer list from the DHT"
            )

    def _header_check(self, *, allowed: set[str], reservation: Reservation) -> Callable:
        """Check a tensor header against this stage of the run's model before any of its payload is
        allocated: its name, dtype and rank, every dimension (samples <= max_microbatch_size, tokens <= the
        model's seq_len, the width of this stage's boundary, the same samples and tokens as the call's other
        tensors), then reserve its bytes from the peer's request memory."""
        stage = self.executor.stage_module
        max_batch, seq_len = self.ctx.max_microbatch_size, stage.config.seq_len
        first: list[tuple[str, int, int]] = []  # (name, samples, tokens) of the call's first tensor

        def check(name: str, shape: tuple[int, ...], dtype: torch.dtype, codec: str) -> None:
            if name not in allowed:
                raise InvalidRequest(
                    f"unexpected tensor '{name}' in this call; expected {sorted(allowed)}"
                )
            if shape and shape[0] > max_batch:
                raise InvalidRequest(
                    f"tensor '{name}' has {shape[0]} samples, more than the "
                    f"{max_batch} this peer accepts per microbatch; split it"
                )
            if name == "tokens":  # (B, T) ids beside a subspace cut's input, in the smallest dtype
                want_dtype, width = token_wire_dtype(stage.config.vocab_size), None
            elif name == "targets" or (name == "input" and stage.is_first):
                want_dtype, width = torch.int64, None  # (B, T) token ids
            elif name == "input":
                want_dtype, width = torch.float32, stage.input_width  # (B, T, D_in)
            else:
                want_dtype, width = torch.float32, stage.output_width  # grad_output: (B, T, D_out)
            want_ndim = 2 if width is None else 3
            if dtype != want_dtype or len(shape) != want_ndim:
                raise InvalidRequest(
                    f"tensor '{name}' for stage {stage.index} must be {want_dtype} with "
                    f"{want_ndim} dims, got {dtype} of shape {list(shape)}"
                )
            samples, tokens = shape[0], shape[1]
            if samples < 1 or not 1 <= tokens <= seq_len or (width and shape[2] != width):
                raise InvalidRequest(
                    f"tensor '{name}' of shape {list(shape)} does not fit stage {stage.index}: it takes "
                    f"1..{max_batch} samples of 1..{seq_len} tokens (the model's seq_len)"
                    + (f" of width {width}" if width else "")
                )
            if first and first[0][1:] != (samples, tokens):
                raise InvalidRequest(
                    f"tensor '{name}' holds {samples} samples of {tokens} tokens, tensor '{first[0][0]}' "
                    f"of this call {first[0][1]} of {first[0][2]}"
                )
            first.append((name, samples, tokens))
            nbytes = math.prod(shape) * dtype.itemsize  # no tensor: a torch op is a GIL handoff
            reservation.reserve(nbytes, f"tensor '{name}' of shape {list(shape)}")

        return check

    def _versioned(self, compute: Callable, params_step: int | None) -> Callable:
        """``compute`` returning also the (step, parameter digest, step of the parameters used if the call was pinned
        to ``params_step``) it ran at, read on the compute thread right after it (a step runs on that thread too, so
        none comes between): a reply names the parameters it came from."""

        def run(*args, **kwargs):
            result = compute(*args, **kwargs)
            if params_step is None:
                return result, (*self.executor.step_and_digest(), None)
            used, digest = self.executor.step_and_digest(params_step)
            return result, (self.executor.step, digest, used)

        return run

    def _reply(
        self,
        *,
        loss: float | None = None,
        num_tensors: int = 0,
        hold_s: float = 0.0,
        version: tuple[int, str, int | None] | None = None,
        compute_s: float = 0.0,
    ) -> pb.Frame:
        step, digest, used = version if version is not None else (self.executor.step, "", None)
        meta = pb.ReplyMeta(
            step=step,
            param_digest=digest,
            state=self.ctx.state(),
            num_tensors=num_tensors,
            commit_hold_s=hold_s,
            compute_s=compute_s,
        )
        if used is not None:
            meta.params_step = used
        if loss is not None:
            meta.loss, meta.has_loss = loss, True
        return pb.Frame(reply=meta)


def _finite_output(forward: Callable, stage_index: int) -> Callable:
    """``forward(microbatch_id, x, ...)``, refusing a non-finite output where it runs: on the compute thread, whose
    torch ops cost the event loop no GIL handoff (the codec checks it again only where its encoding does anyway)."""

    def run(microbatch_id: str, *args, **kwargs):
        output = forward(microbatch_id, *args, **kwargs)
        if not all_finite(output):
            # this replica's fault, not the request's: the caller retries elsewhere
            raise SwarmError(
                f"stage {stage_index} computed non-finite activations for microbatch "
                f"{microbatch_id} on this peer; try another peer of the stage"
            )
        return output

    return run


def _params_step(meta: pb.RequestMeta) -> int | None:
    """The optimizer step whose parameters the call asks for (None: the current ones)."""
    return meta.params_step if meta.HasField("params_step") else None


# push calls remembered for their first commit; more in flight than this at once is not expected of one peer
DEFERRED_IDS = 4096


def _bounded_add(table: OrderedDict, key: str) -> None:
    table[key] = None
    while len(table) > DEFERRED_IDS:
        table.popitem(last=False)


def _work_deadline(context) -> float | None:
    """When the caller stops waiting for this call's reply, on ``time.monotonic()``: the sooner of the gRPC
    deadline and the work timeout the caller sent in metadata (see WORK_TIMEOUT_KEY); None when neither is
    set. A malformed metadata value is ignored (the gRPC deadline still holds)."""
    now = time.monotonic()
    lefts = []
    remaining = context.time_remaining()
    if remaining is not None and math.isfinite(remaining) and remaining < 1e7:
        lefts.append(remaining)
    for key, value in context.invocation_metadata() or ():
        if key == WORK_TIMEOUT_KEY:
            try:
                seconds = float(value)
            except ValueError:
                continue
            if math.isfinite(seconds) and seconds > 0:
                lefts.append(seconds)
    return now + min(lefts) if lefts else None


def _tokens(stage) -> set[str]:
    """The extra tensor a stage after a subspace cut takes with its input: the token ids."""
    return {"tokens"} if stage.takes_tokens else set()


def _joined_input(stage, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stage's forward input from the call's tensors: "input", joined with "tokens" when the stage takes
    them (InvalidRequest when they are missing)."""
    x = _require(tensors, "input")
    if not stage.takes_tokens:
        return x
    try:
        return stage.join_tokens(x, _require(tensors, "tokens"))
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def _require(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise InvalidRequest(f"the call carries no '{name}' tensor (got {sorted(tensors)})")
    return tensors[name]


def _num_samples(meta: pb.RequestMeta, x: torch.Tensor) -> int:
    batch = x.shape[0] if x.ndim else 0
    if meta.num_samples and meta.num_samples != batch:
        raise InvalidRequest(f"num_samples={meta.num_samples} but the tensor holds {batch} samples")
    return batch
