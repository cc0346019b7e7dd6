"""Push mode, the peer's half: a stage's output goes straight to a peer of the next stage, and the gradient comes
straight back (activations never pass through the trainer).

A push call names the stages after the callee (``RequestMeta.route``), each with the candidates the trainer picked
for it, in order. The callee runs its stage keeping what its backward needs, then calls the first candidate of
the next stage with its output, the targets and the rest of the route; a candidate that fails (a transport error,
a deadline, a shed call) is followed by the next one, so a downstream peer lost mid-call costs one hop, never the
microbatch's work at the stages before it. What comes back is the loss and the gradient of this stage's output:
the callee runs its backward and replies with its own input gradient, the loss and the outcome of every hop made
after it (:class:`pb.HopOutcome`), so the trainer, which never saw the activations, keeps routing, bans and
commits: every gradient of a push chain stays held (``defer_commit``) until the trainer commits it with the
Commit RPC.

A chain that cannot finish (every candidate of a stage failed, or a stage's own backward failed) still answers
OK, with ``chain_error`` naming the stage: each peer before it drops what it kept, and the trainer decides.

Peer-to-peer calls are authenticated with this peer's own identity (its caller token), over TLS pinned to the
certificate the trainer read from the callee's signed record.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from swarm.compression import get_codec
from swarm.compression.base import all_finite
from swarm.errors import BadReply, InvalidRequest, SwarmError, WrongPeer, wire_name
from swarm.peer.routecheck import RouteCheck
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.routing.retry import Failure, failure_kind
from swarm.transport.client import ClientPool
from swarm.transport.security import PeerAddress


@dataclass
class Downstream:
    """What the stages after this one came to."""

    loss: float | None = None  # the last stage's, once it answered
    grad_output: torch.Tensor | None = None  # (B, T, D_out): the gradient of this stage's output
    hops: list[pb.HopOutcome] = field(
        default_factory=list
    )  # every hop made after this stage, in order
    waited_s: float = 0.0  # seconds spent on the calls to the next stage
    error: pb.HopOutcome | None = None  # set when the chain did not finish: the stage that failed


def hop_failure(stage: int, peer_id: str, error: BaseException, seconds: float) -> pb.HopOutcome:
    """The outcome of a failed hop: the error's class (BadReply kept apart from transport errors) and sentence."""
    name = "BadReply" if isinstance(error, BadReply) else None
    if name is None and isinstance(error, SwarmError):
        name = wire_name(error)
    return pb.HopOutcome(
        stage=stage,
        peer_id=peer_id,
        error_class=name or "TransportError",
        error=str(error) or type(error).__name__,
        seconds=seconds,
    )


class PushHops:
    """Calls the next stage of a push chain for this peer: one client per callee, signed with this peer's token."""

    def __init__(
        self,
        clients: ClientPool,
        run_id: str,
        *,
        activation_codec: str,
        route_check: RouteCheck | None = None,
    ):
        self.clients = clients
        self.run_id = run_id
        self.codec = get_codec(activation_codec)  # the run's codec for activations
        # which candidates may be dialed (swarm.peer.routecheck); None: any (tests that build no DHT)
        self.route_check = route_check

    async def close(self) -> None:
        await self.clients.close()

    async def send(
        self, meta: pb.RequestMeta, output: torch.Tensor, targets: torch.Tensor
    ) -> Downstream:
        """Send this stage's ``output`` (B, T, D_out) and the ``targets`` down ``meta.route``; try its first stage's
        candidates in order until one answers. Never raises for a downstream failure: it is in ``error``."""
        route = meta.route
        nxt, rest = route[0], route[1:]
        result = Downstream()
        expect = {"grad_input": (tuple(output.shape), torch.float32)}
        for candidate in nxt.candidates:
            request = pb.RequestMeta(
                protocol_version=PROTOCOL_VERSION,
                run_id=self.run_id,
                stage=nxt.stage,
                microbatch_id=meta.microbatch_id,
                codec=meta.codec,  # the reply's: the gradient codec
                num_samples=meta.num_samples,
                compute_loss=not rest,
                defer_commit=True,
                discard_gradients=nxt.discard_gradients,
                route=rest,
            )
            if nxt.HasField("batch_step"):
                request.batch_step = nxt.batch_step
            address = PeerAddress(candidate.endpoint, candidate.peer_id, candidate.tls_cert)
            if self.route_check is not None:
                refusal = await self.route_check.refusal(
                    nxt.stage, candidate.peer_id, candidate.endpoint, candidate.tls_cert
                )
                if refusal is not None:  # never dialed: the next candidate, as for a dead one
                    result.error = hop_failure(
                        nxt.stage, candidate.peer_id, WrongPeer(refusal), 0.0
                    )
                    result.hops.append(result.error)
                    continue
            started = time.monotonic()
            try:
                reply = await self.clients.get(address).forward(
                    request,
                    [("input", output), ("targets", targets)],
                    self.codec,
                    timeout_s=candidate.timeout_s,
                    expect=expect,  # a chain error's reply carries no tensor, which passes
                )
            except SwarmError as e:
                elapsed = time.monotonic() - started
                result.waited_s += elapsed
                outcome = hop_failure(nxt.stage, candidate.peer_id, e, elapsed)
                result.hops.append(outcome)
                result.error = outcome
                if failure_kind(e) is Failure.GIVE_UP:
                    break  # the callee refused what this peer sent: another replica would too
                continue
            elapsed = time.monotonic() - started
            result.waited_s += elapsed
            answered = reply.meta
            result.hops.append(
                pb.HopOutcome(
                    stage=nxt.stage,
                    peer_id=candidate.peer_id,
                    seconds=max(elapsed - answered.downstream_s, 0.0),
                    step=answered.step,
                    state=answered.state,
                    commit_hold_s=answered.commit_hold_s,
                )
            )
            result.hops.extend(answered.hops)
            if answered.has_loss:
                result.loss = answered.loss
            if answered.chain_error.error_class:
                result.error = answered.chain_error
                return result
            grad = reply.tensors.get("grad_input")
            if grad is None or not answered.has_loss:
                result.error = hop_failure(
                    nxt.stage,
                    candidate.peer_id,
                    BadReply(f"peer {address} replied to a push call without a loss or gradient"),
                    0.0,
                )
                result.hops.append(result.error)
                return result
            result.grad_output, result.error = grad, None
            return result
        return result


# Most stages a route may name and candidates per stage (a trainer names two or three; the bound keeps a request's
# header small).
MAX_ROUTE_STAGES, MAX_CANDIDATES = 64, 8


def check_route(meta: pb.RequestMeta, *, is_last: bool) -> None:
    """A push call's route names the stages after the callee, in order, each with 1..MAX_CANDIDATES candidates with
    an endpoint and a finite positive deadline (InvalidRequest otherwise, before any work)."""
    if is_last:
        raise InvalidRequest("the last stage has no stage to push to; send it no route")
    if meta.compute_loss or meta.eval_only:
        raise InvalidRequest(
            "a push call (with a route) is a training forward: no compute_loss, no eval_only"
        )
    if len(meta.route) > MAX_ROUTE_STAGES:
        raise InvalidRequest(
            f"the route names {len(meta.route)} stages, at most {MAX_ROUTE_STAGES} are accepted"
        )
    for k, hop in enumerate(meta.route):
        if hop.stage != meta.stage + 1 + k:
            raise InvalidRequest(
                f"route entry {k} is for stage {hop.stage}, expected stage {meta.stage + 1 + k} (the stages after "
                f"this one, in order)"
            )
        if not 1 <= len(hop.candidates) <= MAX_CANDIDATES:
            raise InvalidRequest(
                f"route entry for stage {hop.stage} names {len(hop.candidates)} candidates; give 1..{MAX_CANDIDATES}"
            )
        for c in hop.candidates:
            if not c.endpoint or not math.isfinite(c.timeout_s) or c.timeout_s <= 0:
                raise InvalidRequest(
                    f"a candidate of stage {hop.stage} needs an endpoint and a deadline > 0 s, got "
                    f"{c.endpoint!r} and {c.timeout_s}"
                )


async def serve_push(service, reader, frames, meta: pb.RequestMeta, codec, x, targets, work: dict):
    """The push call at this peer (``service``: the StageService): forward keeping the graph, the next stages
    through :meth:`PushHops.send`, then this stage's backward with the gradient that came back, all under one
    call. Yields the reply frames; the gradients stay held for the trainer's Commit RPC."""
    hops, executor = service.ctx.push, service.executor
    if hops is None:
        raise InvalidRequest("this peer does not serve push calls; send the microbatch relayed")
    stage = executor.stage_module
    # a pinned push call (RequestMeta.params_step) computes this stage on that step's parameters, as a relayed one
    params_step = meta.params_step if meta.HasField("params_step") else None
    output, version = await service._compute(
        service._versioned(executor.forward, params_step),
        meta.microbatch_id,
        x,
        keep=True,
        params_step=params_step,
        work=dict(work, forward=True, backward=False),
    )
    down = None
    try:
        if not all_finite(output):
            raise SwarmError(
                f"stage {stage.index} computed non-finite activations for microbatch {meta.microbatch_id} on "
                f"this peer; try another peer of the stage"
            )
        down = await hops.send(meta, output, targets)
        if down.error is None:
            grad_input = await service._compute(
                executor.backward,
                meta.microbatch_id,
                down.grad_output,
                None,
                x.shape[0],
                params_step,
                work=dict(work, forward=False, backward=True),
            )
    except SwarmError as e:
        if down is None:
            raise  # nothing ran after this stage: the caller sees this peer's error
        # this stage's own backward failed: the stages after it answered and hold their gradients
        down.error = hop_failure(meta.stage, service.ctx.peer_id, e, 0.0)
    finally:
        service.ctx.submit_urgent(executor.release, meta.microbatch_id)
    push = dict(hops=down.hops, downstream_s=down.waited_s)
    if down.error is not None:
        reply = service._reply(loss=down.loss, version=version)
        reply.reply.hops.extend(down.hops)
        reply.reply.downstream_s = down.waited_s
        reply.reply.chain_error.CopyFrom(down.error)
        yield reply
        return
    async for frame in service._reply_and_commit(
        reader, frames, meta, codec, grad_input, loss=down.loss, version=version, push=push
    ):
        yield frame
