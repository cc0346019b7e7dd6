"""Push mode: activations go peer to peer, the trainer sends tokens and gets the loss and every hop's outcome (real
peers in this process, a real DHT, real gRPC over TLS; swarm.peer.push and swarm.trainer.push)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
import torch

from swarm.compression import get_codec
from swarm.config import RunConfig
from swarm.model import ModelConfig, build_full_model
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.trainer.config import PipelineConfig
from swarm.trainer.pipeline import Pipeline
from swarm.transport.client import PeerClient

pytestmark = pytest.mark.integration

B, T = 2, 16


def model_run(num_stages: int, **fields) -> RunConfig:
    """A tiny run cut into ``num_stages``; no optimizer step unless ``fields`` say so (raw gradients compare)."""
    model = ModelConfig(d_model=32, n_heads=2, n_layers=3, seq_len=T, num_stages=num_stages, seed=7)
    return RunConfig(model=model, **{"target_batch_size": 10**6, **fields})


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(seed))


@contextlib.asynccontextmanager
async def push_pipeline(directory, run: RunConfig, replicas: list[int], **config):
    """A push-mode trainer pipeline once ``replicas[k]`` peers of every stage k are announced."""
    pipeline = Pipeline(
        directory,
        run,
        config=PipelineConfig(activations="push", spot_check_share=0, **config),
        seed=0,
    )
    await pipeline.start()
    try:
        deadline = time.monotonic() + 30
        while any(len(pipeline.router.peers(k)) < n for k, n in enumerate(replicas)):
            assert time.monotonic() < deadline, [
                pipeline.router.peers(k) for k in range(len(replicas))
            ]
            await pipeline._next_refresh(timeout_s=1.0)
        yield pipeline
    finally:
        await pipeline.close()


async def state(peer, *, grads: bool = False):
    client = PeerClient(peer.address)
    try:
        return await client.get_state(peer.run_id, include_grads=grads, timeout_s=30)
    finally:
        await client.close()


async def dialable_from(sender, peer, timeout_s: float = 30.0) -> None:
    """Wait until ``sender`` would push to ``peer``: a record of its stage has reached ``sender``'s DHT view."""
    check, address = sender.push_hops.route_check, peer.address
    deadline = time.monotonic() + timeout_s
    while refusal := await check.refusal(
        peer.stage_index, peer.peer_id, address.endpoint, address.tls_cert
    ):
        assert time.monotonic() < deadline, refusal
        await asyncio.sleep(0.2)  # the check re-reads the DHT at most once a second


@pytest.mark.parametrize("num_stages", [2, 3])
def test_a_pushed_microbatch_matches_one_process_and_counts_once_per_stage(
    peers, loop_thread, num_stages
):
    """Loss and every parameter gradient equal the unsplit model's (codec none), and each stage counted it once,
    with the trainer sending only tokens: no activation passed through it."""
    run_id, run = f"push-eq{num_stages}", model_run(num_stages)
    stage_peers = [peers(run_id, k, run=run) for k in range(num_stages)]
    tokens = batch(3)

    async def body():
        async with push_pipeline(stage_peers[-1].directory, run, [1] * num_stages) as pipeline:
            result = await pipeline.train_microbatch("mb-1", tokens)
            return result, [await state(p, grads=True) for p in stage_peers], pipeline.failed_calls

    result, states, failed = loop_thread.run(body())
    full = build_full_model(run.model)
    loss = full.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert failed == 0
    assert result.loss == pytest.approx(float(loss), rel=1e-5, abs=1e-6)
    for k, (peer, got) in enumerate(zip(stage_peers, states)):
        assert peer.executor.microbatches_applied == 1, k
        assert got.meta.samples_accumulated == B
        for name, p in full.stages[k].named_parameters():
            torch.testing.assert_close(
                got.tensors[f"grad/{name}"] / B,
                p.grad,
                rtol=1e-4,
                atol=1e-6,
                msg=f"stage {k} {name}",
            )


def test_a_dead_downstream_peer_is_replaced_within_the_call_and_commits_count_once(
    peers, loop_thread
):
    """Stage 0 pushes to the candidates of stage 1 in turn: the first is dead, the second answers. The chain
    finishes in the same call (stage 0 computed once), the reply names the failed hop, and the gradients held at
    each stage count once through the Commit RPC (a second commit is answered 'already applied')."""
    run_id, run = "push-dead", model_run(3)
    first, dead, alive, last = (
        peers(run_id, 0, run=run),
        peers(run_id, 1, run=run),
        peers(run_id, 1, run=run),
        peers(run_id, 2, run=run),
    )
    # stage 0 dials only peers a record of stage 1 announces; it read `dead`'s while it lived (it stays known a
    # while after its record expires: a route a few heartbeats old gets a dead peer's failure, not a refusal)
    # stage 0 dials only peers a record of stage 1 announces: it reads `dead`'s while it lives (a peer stays known a
    # while after its record expires: a route a few heartbeats old gets a dead peer's failure, not a refusal)
    loop_thread.run(dialable_from(first, dead))
    loop_thread.run(dead.shutdown())
    tokens = batch(5)
    codec = get_codec("none")

    def candidate(peer, timeout_s=20.0):
        a = peer.address
        return pb.Candidate(
            endpoint=a.endpoint, peer_id=a.peer_id, tls_cert=a.tls_cert, timeout_s=timeout_s
        )

    async def body():
        meta = pb.RequestMeta(
            protocol_version=PROTOCOL_VERSION,
            run_id=run_id,
            stage=0,
            microbatch_id="mb-dead",
            codec="none",
            num_samples=B,
            defer_commit=True,
        )
        meta.route.add(stage=1).candidates.extend([candidate(dead), candidate(alive)])
        meta.route.add(stage=2).candidates.extend([candidate(last)])
        client = PeerClient(first.address)
        try:
            reply = await client.forward(
                meta,
                [("input", tokens[:, :-1]), ("targets", tokens[:, 1:])],
                codec,
                timeout_s=60,
                expect={},
            )
            applied = []
            for peer in (last, alive, first):  # the last stage held its gradients the longest
                other = PeerClient(peer.address)
                try:
                    applied.append(
                        [
                            await other.commit(run_id, peer.stage_index, "mb-dead", None, 10),
                            await other.commit(run_id, peer.stage_index, "mb-dead", None, 10),
                        ]
                    )
                finally:
                    await other.close()
            return reply, applied
        finally:
            await client.close()

    reply, applied = loop_thread.run(body())
    hops = [(h.stage, h.peer_id, h.error_class) for h in reply.meta.hops]
    assert hops[0][:2] == (1, dead.peer_id) and hops[0][2] == "TransportError", reply.meta.hops
    assert hops[1:] == [(1, alive.peer_id, ""), (2, last.peer_id, "")]
    assert not reply.meta.chain_error.error_class and reply.meta.has_loss
    full = build_full_model(run.model)
    assert reply.meta.loss == pytest.approx(
        float(full.loss(tokens[:, :-1], tokens[:, 1:])), rel=1e-5
    )
    assert applied == [[True, False]] * 3
    assert [p.executor.microbatches_applied for p in (first, alive, last)] == [1, 1, 1]


def test_push_training_survives_a_killed_replica_and_counts_every_microbatch_once(
    peers, loop_thread
):
    """A push-mode trainer on 2 stages, stage 1 with two replicas, one killed mid-run while its record still
    lists it: every microbatch completes, the failure is seen and routed around, each stage counts each
    microbatch once, and the loss falls."""
    run_id = "push-kill"
    run = model_run(2, target_batch_size=B, warmup_steps=0, lr=3e-3)
    head, keep, victim = (
        peers(run_id, 0, run=run),
        peers(run_id, 1, run=run),
        peers(run_id, 1, run=run),
    )
    tokens = batch(11)  # one batch again and again: its loss must fall

    async def body():
        async with push_pipeline(head.directory, run, [1, 2]) as pipeline:
            losses = [(await pipeline.train_microbatch(f"mb{i}", tokens)).loss for i in range(3)]
            before = victim.executor.microbatches_applied
            await victim.shutdown()  # killed: no drain, its record stays until its TTL
            # Routing is random: the dead replica is named first within a few microbatches (never in 40: p = 2**-40).
            n = 3
            while pipeline.failed_calls == 0 and n < 43:
                losses.append((await pipeline.train_microbatch(f"mb{n}", tokens)).loss)
                n += 1
            for _ in range(3):
                losses.append((await pipeline.train_microbatch(f"mb{n}", tokens)).loss)
                n += 1
            return losses, n, before, pipeline.failed_calls, pipeline.unconfirmed_commits

    losses, n, before, failed, unconfirmed = loop_thread.run(body(), timeout_s=300)
    assert failed > 0
    assert unconfirmed == 0
    assert head.executor.microbatches_applied == n
    assert keep.executor.microbatches_applied + before == n
    assert losses[-1] < 0.9 * losses[0], losses


def test_lost_push_commits_are_settled_and_each_stage_counts_each_microbatch_once(
    peers, loop_thread
):
    """Both peers lose 60% of the first commits of push calls, a third each way (before applying them, the
    confirmation after, or as if past the hold: dropped). The trainer asks again, or computes a dropped gradient
    again with a fresh chain of which only that stage keeps its gradient: each stage counts each microbatch once."""
    run_id, run = "push-lost", model_run(2)
    lossy = dict(lose_commit_probability=0.6)
    first, last = peers(run_id, 0, run=run, **lossy), peers(run_id, 1, run=run, **lossy)
    n = 12

    async def body():
        async with push_pipeline(first.directory, run, [1, 1]) as pipeline:
            for i in range(n):
                await pipeline.train_microbatch(f"mb{i}", batch(i))
            late = 0
            for peer in (first, last):
                client = PeerClient(peer.address)
                try:
                    late += (await client.info(run_id, timeout_s=10)).late_commits
                finally:
                    await client.close()
            return (
                pipeline.recomputed_gradients,
                pipeline.unconfirmed_commits,
                pipeline.failed_calls,
                late,
            )

    recomputed, unconfirmed, failed, late = loop_thread.run(body(), timeout_s=300)
    assert unconfirmed == 0 and failed == 0
    assert [p.executor.microbatches_applied for p in (first, last)] == [n, n]
    # Each way happened: with 24 first commits lost with probability 0.2 each way, none "late" has p = 0.8**24.
    assert recomputed > 0
    assert late > 0


def test_a_route_naming_an_address_no_record_announces_is_never_dialed(peers, loop_thread):
    """A caller names the stage-1 peer's id at another address (a port of the peer's host it wants probed), then a
    peer id no record announces: stage 0 dials neither (no connection reaches the listener), answers with a
    WrongPeer hop for each, and takes the next candidate, the real one."""
    run_id, run = "push-route", model_run(2)
    first, last = peers(run_id, 0, run=run), peers(run_id, 1, run=run)
    probe = socket.create_server(("127.0.0.1", 0))
    probe.setblocking(False)
    lure = f"127.0.0.1:{probe.getsockname()[1]}"
    real = last.address
    loop_thread.run(dialable_from(first, last))
    tokens = batch(9)

    async def push(microbatch_id, *candidates):
        meta = pb.RequestMeta(
            protocol_version=PROTOCOL_VERSION,
            run_id=run_id,
            stage=0,
            microbatch_id=microbatch_id,
            codec="none",
            num_samples=B,
            defer_commit=True,
        )
        meta.route.add(stage=1).candidates.extend(
            pb.Candidate(endpoint=e, peer_id=p, tls_cert=real.tls_cert, timeout_s=20.0)
            for e, p in candidates
        )
        client = PeerClient(first.address)
        try:
            return await client.forward(
                meta,
                [("input", tokens[:, :-1]), ("targets", tokens[:, 1:])],
                get_codec("none"),
                timeout_s=60,
                expect={},
            )
        finally:
            await client.close()

    try:
        redirected = loop_thread.run(
            push("mb-lure", (lure, real.peer_id), (real.endpoint, real.peer_id))
        )
        unknown = loop_thread.run(push("mb-unknown", (lure, "ab" * 8)))
        with pytest.raises(BlockingIOError):
            probe.accept()  # nothing connected to the lure
    finally:
        probe.close()
    hops = [(h.stage, h.peer_id, h.error_class) for h in redirected.meta.hops]
    assert hops == [(1, real.peer_id, "WrongPeer"), (1, real.peer_id, "")], redirected.meta.hops
    assert f"announces endpoint {real.endpoint}, not {lure}" in redirected.meta.hops[0].error
    assert redirected.meta.has_loss and not redirected.meta.chain_error.error_class
    assert unknown.meta.chain_error.error_class == "WrongPeer"
    assert "no record of stage 1" in unknown.meta.chain_error.error
