"""Push mode, the trainer's half: the trainer sends a microbatch's tokens and targets to a peer of stage 0 with the
route for the later stages; each stage sends its output straight to the next stage's peer and the gradients flow
straight back (see swarm.peer.push). The trainer's link carries tokens and a small reply, not activations.

The trainer still decides everything a relayed trainer does: routing picks each stage's peer (weighted by measured
speed) and ``push_candidates - 1`` other replicas the stage before it tries in turn when a call fails, so a
downstream peer lost mid-call costs one hop, not the microbatch; deadlines are set per hop from the routing
estimates of the stages after it; every hop's outcome comes back in the reply and feeds the router (speed, bans
with back-off, retry budgets) as a relayed call would. A chain that cannot finish (all candidates of a stage
failed) is sent again from stage 0 under a new id, within the stages' retry budgets.

Exactly once: every gradient of a chain stays held at its peer (``defer_commit``) until the trainer commits it
through the Commit RPC, stage by stage, with the same outcome rules as a relayed call (swarm.trainer.commits). A
stage that did not count it gets it computed again by a fresh chain of which only that stage is committed (the
other stages' holds expire uncommitted: nothing counts twice). Gradients of an unfinished chain are never
committed.

What a relayed trainer checks that push mode cannot: the activations themselves. Spot-checks and the peers other
trainers reported go through the relayed path (a sampled microbatch is sent relayed and every stage of it
checked); a hop's failure is the calling peer's word, so it bans with back-off, never for the run.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from swarm.errors import (
    WIRE_ERRORS,
    BadReply,
    GradientOutlier,
    InvalidRequest,
    SwarmError,
    TransportError,
)
from swarm.proto import swarm_pb2 as pb
from swarm.routing import NoPeersAvailable, StageRequest
from swarm.routing.retry import Failure, failure_kind
from swarm.states import PeerState
from swarm.trainer.commits import COMMIT_TIMEOUT_S
from swarm.trainer.work import BACKWARD_COST, FORWARD_COST, MicrobatchResult
from swarm.transport.client import Reply
from swarm.transport.security import PeerAddress

logger = logging.getLogger(__name__)

# Error classes a hop outcome may name (BadReply is the caller's verdict on a reply, never sent as a status).
_HOP_ERRORS = {cls.__name__: cls for cls in (*WIRE_ERRORS, BadReply)}


@dataclass
class Held:
    """A stage's gradient of a finished chain, held at its peer for the trainer's commit."""

    peer: str
    address: PeerAddress
    microbatch_id: str  # the chain's id, under which the peer holds it
    hold_until: (
        float  # time.monotonic() until which the peer holds it (counted from the reply's arrival)
    )


@dataclass
class Chain:
    loss: float
    held: dict[int, Held] = field(default_factory=dict)  # stage -> its held gradient
    first_counted: int = (
        0  # stages before this one refused the gradient (outlier): they count nothing
    )


class PushChains:
    """Push-mode microbatches of one :class:`~swarm.trainer.pipeline.Pipeline` (its router, records, clients and
    bookkeeping)."""

    def __init__(self, pipeline):
        self.p = pipeline
        self._ids = itertools.count(1)

    async def train(self, microbatch_id: str, tokens: torch.Tensor, batch_steps):
        """One microbatch pushed through the stages; returns a MicrobatchResult (see Pipeline.train_microbatch)."""
        p = self.p
        x, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T) each
        failures_before = p.failed_calls
        tags = batch_steps or [None] * p.num_stages
        chain = await self.complete(microbatch_id, x, targets, tags)
        stages = sorted(chain.held)
        recomputes = {
            s: functools.partial(self._recompute, s, microbatch_id, x, targets, tags)
            for s in stages
        }
        settled = await asyncio.gather(
            *(
                p._settle(
                    microbatch_id,
                    s,
                    self._commit(s, chain.held[s], tags[s]),
                    chain.held[s].peer,
                    recomputes[s],
                )
                for s in stages
            ),
            return_exceptions=True,
        )
        if errors := [e for e in settled if isinstance(e, BaseException)]:
            raise errors[0]
        for s, counted_at in zip(stages, settled):
            p.holdings.add(
                s,
                tags[s],
                counted_at,
                microbatch_id,
                functools.partial(p._redo, microbatch_id, s, recomputes[s]),
            )
        return MicrobatchResult(
            loss=chain.loss,
            samples=x.shape[0],
            tokens=targets.numel(),
            attempts_failed=p.failed_calls - failures_before,
        )

    async def _recompute(
        self, stage: int, microbatch_id: str, x, targets, tags
    ) -> tuple[Reply, str]:
        """``stage``'s gradient of this microbatch once more: a fresh chain of which only that stage is committed."""
        chain = await self.complete(
            f"{microbatch_id}~redo{next(self._ids)}", x, targets, tags, only=stage
        )
        if stage not in chain.held:
            raise SwarmError(
                f"stage {stage} refused the gradient of microbatch {microbatch_id} computed again (an outlier)"
            )
        held = chain.held[stage]
        return self._commit(stage, held, tags[stage]), held.peer

    def _commit(self, stage: int, held: Held, batch_step: int | None) -> Reply:
        """Commit ``held`` through the Commit RPC; a Reply that swarm.trainer.commits reads like a relayed one's."""
        key = (self.p.run_id, stage, held.microbatch_id, batch_step)
        again = functools.partial(self.p.clients.get(held.address).commit, *key)
        return Reply(
            meta=pb.ReplyMeta(),
            tensors={},
            committed=asyncio.ensure_future(again(COMMIT_TIMEOUT_S)),
            commit_again=again,
            hold_until=held.hold_until,
            commit_key=key,
        )

    # ------------------------------------------------------------------ chains

    async def complete(self, base_id: str, x, targets, tags, *, only: int | None = None) -> Chain:
        """Push chains for these tokens until one finishes (``only``: the one stage that keeps its gradient, the
        others compute theirs and drop it); raises RetriesExhausted (a stage's retry budget spent),
        StageUnavailable, or the request's own error (e.g. stage 0 refused the tokens)."""
        p = self.p
        requests = [StageRequest(p.router, s) for s in range(p.num_stages)]
        cost = x.shape[0] * (FORWARD_COST + BACKWARD_COST)
        suspect = None
        limit = 4 * p.num_stages * p.router.config.max_attempts
        for n in range(limit):
            chain_id = base_id if n == 0 else f"{base_id}~{next(self._ids)}"
            route = await self._route(requests, cost)
            chain, refused = await self._push(
                chain_id, route, x, targets, tags, requests, cost, only
            )
            if chain is not None:
                return chain
            if refused is None:
                continue  # a stage's candidates all failed: charged to its budget, send it again
            stage, error = refused
            # Stage ``stage`` refused the output of the chain's peer of the stage before it: as relayed, ask
            # another peer of that stage once; if the call then passes, the first one sent something wrong.
            sender = route[stage - 1][0][0] if stage else None
            others = set(p.router.peers(stage - 1)) - {sender} if stage else set()
            if stage == 0 or suspect is not None or not others:
                if suspect is not None:
                    p._unban(suspect)
                raise error
            suspect = sender
            p._ban_for_run(stage - 1, sender, error, f"stage {stage} refused its output")
        raise SwarmError(
            f"microbatch {base_id}: {limit} push chains failed; see the log for each hop"
        )

    async def _route(self, requests: list[StageRequest], cost: float):
        """Per stage, the candidates in order: (peer, its record, the deadline of a call to it and the stages
        after it). The first is the one routing picked; the others are replicas not yet failed for this request."""
        p = self.p
        route = []
        for stage, request in enumerate(requests):
            primary = await p._choose(request)
            picked = [(primary, p.records[stage][primary])]
            while len(picked) < p.config.push_candidates:
                try:
                    other = p.router.choose(
                        stage,
                        time.monotonic(),
                        p.rng,
                        exclude={peer for peer, _ in picked} | request.failed_peers,
                    )
                except NoPeersAvailable:
                    break
                picked.append((other, p.records[stage][other]))
            route.append(picked)
        below = 0.0  # worst case of the stages after: every candidate tried, each to its deadline
        timed = []
        # A stage's own part: what a relayed forward and backward call to it would get, each (a push call waits for
        # the peer's compute twice, forward then backward, as the two relayed calls do).
        forward = cost * FORWARD_COST / (FORWARD_COST + BACKWARD_COST)
        for stage in reversed(range(len(route))):
            here = [
                (
                    peer,
                    rec,
                    p.call_timeout_s(stage, rec, forward)
                    + p.call_timeout_s(stage, rec, cost - forward)
                    + below,
                )
                for peer, rec in route[stage]
            ]
            below = sum(t for _, _, t in here)
            timed.append(here)
        return timed[::-1]

    async def _push(self, chain_id, route, x, targets, tags, requests, cost, only):
        """One chain. Returns (Chain, None) when it finished, (None, (stage, error)) when ``stage`` refused its
        input as invalid, (None, None) when it failed otherwise (the failures charged to the stages' budgets)."""
        p = self.p
        meta = p.calls.meta(
            0,
            chain_id,
            x.shape[0],
            tags[0],
            codec=p.grad_codec,
            defer_commit=True,
            discard_gradients=only not in (None, 0),
        )
        for stage in range(1, p.num_stages):
            hop = meta.route.add(stage=stage, discard_gradients=only not in (None, stage))
            if tags[stage] is not None:
                hop.batch_step = tags[stage]
            for peer, rec, timeout_s in route[stage]:
                hop.candidates.add(
                    endpoint=rec.endpoint, peer_id=peer, tls_cert=rec.tls_cert, timeout_s=timeout_s
                )
        first, rec0, timeout_s = route[0][0]
        started = time.monotonic()
        in_flight = {(stage, cands[0][0]) for stage, cands in enumerate(route)}
        for stage, peer in in_flight:
            p.router.on_start(stage, peer, started)
        try:
            try:
                reply = await p.clients.get(PeerAddress.of(rec0)).forward(
                    meta,
                    [("input", x), ("targets", targets)],
                    p.codec,
                    timeout_s=timeout_s,
                    expect={},
                )
            except SwarmError as e:
                in_flight.discard((0, first))
                p._failed(
                    requests[0], 0, first, e
                )  # raises the request's own error, or spent budgets
                return None, None
            now = time.monotonic()
            answered = reply.meta
            held = {}
            hops = [
                pb.HopOutcome(
                    stage=0,
                    peer_id=first,
                    seconds=max(now - started - answered.downstream_s, 0.0),
                    step=answered.step,
                    state=answered.state,
                    commit_hold_s=answered.commit_hold_s,
                ),
                *answered.hops,
            ]
            addresses = {
                (s, peer): PeerAddress.of(rec)
                for s, cands in enumerate(route)
                for peer, rec, _ in cands
            }
            for hop in hops:
                key = (hop.stage, hop.peer_id)
                if (
                    key not in addresses
                ):  # a peer the route did not name: the reply is not to be trusted
                    return self._untrusted(
                        requests, first, f"a hop to {hop.peer_id}, which the route did not name"
                    )
                if key in in_flight:
                    in_flight.discard(key)
                else:
                    p.router.on_start(hop.stage, hop.peer_id, now)
                if hop.error_class:
                    error = _rebuilt(hop)
                    if failure_kind(error) is Failure.GIVE_UP:
                        p.router.on_cancel(hop.stage, hop.peer_id, now)
                    else:
                        p._failed(requests[hop.stage], hop.stage, hop.peer_id, error, reported=True)
                    continue
                p.router.on_success(hop.stage, hop.peer_id, cost, max(hop.seconds, 1e-6), now)
                p.steps.replied(hop.stage, hop.step)
                if (
                    hop.state == PeerState.DRAINING
                    and (hop.stage, hop.peer_id) not in p._draining_replies
                ):
                    p._draining_replies[(hop.stage, hop.peer_id)] = now
                    p._update_router(hop.stage, now)
                if only in (None, hop.stage):
                    held[hop.stage] = Held(
                        hop.peer_id, addresses[key], chain_id, now + hop.commit_hold_s
                    )
            fault = answered.chain_error
            if not fault.error_class:
                wanted = list(range(p.num_stages)) if only is None else [only]
                if sorted(held) != wanted or not answered.has_loss:
                    return self._untrusted(
                        requests, first, "a finished chain without every stage or a loss"
                    )
                return Chain(answered.loss, held), None
            error = _rebuilt(fault)
            if fault in answered.hops:  # a hop failed: charged above
                if failure_kind(error) is not Failure.GIVE_UP:
                    return None, None
                if isinstance(error, InvalidRequest):
                    return None, (fault.stage, error)
                raise error
            # the stage's own backward failed (its hop answered): the stages after it hold their gradients
            if isinstance(error, GradientOutlier):
                p.refused_gradients += 1
                p.lost_gradients += 1
                logger.warning(
                    "microbatch %s counts at stages %d+ only: stage %d peer %s refused the gradient it got (%s)",
                    chain_id,
                    fault.stage + 1,
                    fault.stage,
                    fault.peer_id,
                    error,
                )
                kept = {s: h for s, h in held.items() if s > fault.stage}
                return Chain(answered.loss, kept, first_counted=fault.stage + 1), None
            p._failed(requests[fault.stage], fault.stage, fault.peer_id, error, reported=True)
            return None, None
        finally:
            for stage, peer in in_flight:
                p.router.on_cancel(stage, peer, time.monotonic())

    def _untrusted(self, requests, first: str, what: str):
        """Stage 0's reply reported ``what``: no honest chain does. Its peer is banned with back-off (it may only
        pass on what a later peer told it) and the chain is sent again."""
        error = BadReply(f"stage 0 peer {first} reported {what}")
        self.p._failed(requests[0], 0, first, error, reported=True)
        return None, None


def _rebuilt(hop: pb.HopOutcome) -> SwarmError:
    """The error a hop outcome names, as its class (an unknown name: a transport error)."""
    cls = _HOP_ERRORS.get(hop.error_class, TransportError)
    return cls(f"stage {hop.stage} peer {hop.peer_id}: {hop.error}")
