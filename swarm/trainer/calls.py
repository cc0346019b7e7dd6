"""How the trainer's calls to a stage are built: the request header, the tensors sent, the reply expected (shapes,
dtypes, a gradient's plausibility) and the codec each way. Each builder returns an attempt ``(address, timeout_s) ->
Reply`` for the pipeline's one retry helper (:meth:`Pipeline._call`), which picks the peer."""

from __future__ import annotations

import torch

from swarm.config import RunConfig
from swarm.discovery.records import StageRecord
from swarm.errors import NotCached
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.trainer.gradwatch import GradientWatch
from swarm.transport.client import ClientPool, Reply
from swarm.transport.security import PeerAddress


class StageCalls:
    """The calls of one run's trainer: ``records`` (stage -> peer id -> record) are the pipeline's, refreshed in
    place; a backward goes to the forward's peer only while its record names the address tried."""

    def __init__(
        self,
        run_id: str,
        run: RunConfig,
        records: list[dict[str, StageRecord]],
        clients: ClientPool,
        *,
        codec,
        grad_codec,
        gradients: GradientWatch,
    ):
        self.run_id, self.run, self.records, self.clients = run_id, run, records, clients
        self.num_stages = run.model.num_stages
        self.codec, self.grad_codec, self.gradients = codec, grad_codec, gradients

    def meta(
        self,
        stage: int,
        microbatch_id: str,
        samples: int,
        batch_step: int | None = None,
        *,
        codec,
        params_step: int | None = None,
        **flags,
    ) -> pb.RequestMeta:
        """The request header; ``codec`` is what the peer replies in (tensors carry their own codec);
        ``params_step``: the optimizer step whose parameters the peer computes with (None: its current ones)."""
        meta = pb.RequestMeta(
            protocol_version=PROTOCOL_VERSION,
            run_id=self.run_id,
            stage=stage,
            microbatch_id=microbatch_id,
            codec=codec.name,
            num_samples=samples,
            **flags,
        )
        if batch_step is not None:
            meta.batch_step = batch_step
        if params_step is not None:
            meta.params_step = params_step
        return meta

    def with_tokens(self, stage: int, tensors: list, tokens: torch.Tensor) -> list:
        """``tensors`` plus the microbatch's token ids (B, T) when ``stage`` takes them (the subspace cut, see
        swarm.model.subspace), in the smallest integer dtype that holds the vocabulary."""
        if not self.run.model.takes_tokens(stage):
            return tensors
        from swarm.model.subspace import token_wire_dtype

        return [*tensors, ("tokens", tokens.to(token_wire_dtype(self.run.model.vocab_size)))]

    def forward(
        self,
        stage,
        microbatch_id,
        h,
        *,
        tokens,
        targets=None,
        eval_only=False,
        batch_step=None,
        params_step=None,
    ):
        """``tokens``: the microbatch's input ids (B, T), sent along where the stage takes them."""
        tensors = [("input", h)] + ([("targets", targets)] if targets is not None else [])
        tensors = self.with_tokens(stage, tensors, tokens)
        compute_loss = targets is not None and not eval_only
        if stage < self.num_stages - 1:  # (B, T, width of the next cut)
            width = self.run.model.boundary_dim(stage + 1)
            expect = {"output": ((*h.shape[:2], width), torch.float32)}
        else:
            expect = self.expect_grad(stage, h) if compute_loss else {}
        judge = self.gradients.judge(stage, h.shape[0]) if compute_loss else None
        meta = self.meta(
            stage,
            microbatch_id,
            h.shape[0],
            batch_step,
            # the loss call replies with the input's gradient, a forward call with activations
            codec=self.grad_codec if compute_loss else self.codec,
            compute_loss=compute_loss,
            eval_only=eval_only,
            params_step=params_step,
        )

        async def attempt(address: PeerAddress, timeout_s: float) -> Reply:
            return await self.clients.get(address).forward(
                meta, tensors, self.codec, timeout_s=timeout_s, expect=expect, judge=judge
            )

        return attempt

    def backward(
        self, stage, microbatch_id, grad, inputs, tokens, forward_peer, batch_step, params_step=None
    ):
        async def attempt(address: PeerAddress, timeout_s: float) -> Reply:
            client = self.clients.get(address)
            holder = self.records[stage].get(forward_peer)
            if holder is not None and PeerAddress.of(holder) == address:
                try:
                    meta = self.meta(
                        stage,
                        microbatch_id,
                        grad.shape[0],
                        batch_step,
                        codec=self.grad_codec,
                        params_step=params_step,
                    )
                    return await client.backward(
                        meta,
                        [("grad_output", grad)],
                        self.grad_codec,
                        timeout_s=timeout_s,
                        expect=self.expect_grad(stage, inputs),
                        judge=self.gradients.judge(stage, grad.shape[0]),
                    )
                except NotCached:
                    pass  # evicted there: send the inputs along for a recompute at the same peer
            return await with_inputs(address, timeout_s)

        with_inputs = self.backward_with_inputs(
            stage, microbatch_id, grad, inputs, tokens, batch_step, params_step
        )
        return attempt

    def backward_with_inputs(
        self, stage, microbatch_id, grad, inputs, tokens, batch_step, params_step=None
    ):
        meta = self.meta(
            stage,
            microbatch_id,
            grad.shape[0],
            batch_step,
            codec=self.grad_codec,
            include_inputs=True,
            params_step=params_step,
        )

        async def attempt(address: PeerAddress, timeout_s: float) -> Reply:
            # one codec per call: the inputs of this recompute travel in the gradient codec too
            return await self.clients.get(address).backward(
                meta,
                self.with_tokens(stage, [("grad_output", grad), ("input", inputs)], tokens),
                self.grad_codec,
                timeout_s=timeout_s,
                expect=self.expect_grad(stage, inputs),
                judge=self.gradients.judge(stage, grad.shape[0]),
            )

        return attempt

    @staticmethod
    def expect_grad(stage: int, inputs: torch.Tensor) -> dict:
        """A gradient call's reply: the gradient of the stage's input, shaped like it (none for stage 0, whose
        input is token ids)."""
        return {} if stage == 0 else {"grad_input": (tuple(inputs.shape), torch.float32)}
