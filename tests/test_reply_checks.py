"""The trainer checks every reply: a peer that sends a wrong one is banned for the run, its microbatch goes to
another peer, and training goes on (real peers, real DHT, real gRPC; the trainer's pipeline in this process)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from livepeers import RUN, T

from swarm.trainer.config import PipelineConfig
from swarm.trainer.pipeline import Pipeline

pytestmark = pytest.mark.integration

B = 2


@contextlib.asynccontextmanager
async def _pipeline(directory, *, both_at: int, _min_peers: int = 2, **config):
    """The trainer's pipeline of RUN (``config``: PipelineConfig fields), once both peers (or ``_min_peers``) of
    stage ``both_at`` are announced."""
    pipeline = Pipeline(directory, RUN, config=PipelineConfig(**config), seed=0)
    await pipeline.start()
    try:
        deadline = time.monotonic() + 30
        while len(pipeline.router.peers(both_at)) < _min_peers:
            assert time.monotonic() < deadline, pipeline.router.peers(both_at)
            await pipeline._next_refresh(timeout_s=1.0)
        yield pipeline
    finally:
        await pipeline.close()


def _wrong_shape(out: torch.Tensor) -> torch.Tensor:
    return out[:, :-1]  # one token short


def _nan(out: torch.Tensor) -> torch.Tensor:
    # an honest peer whose replica diverged: it answers with an error of its own (banned with back-off only)
    return out.clone().fill_(float("nan"))


def _overflow(out: torch.Tensor) -> torch.Tensor:
    # finite, so it passes the trainer's own checks; the next stage's loss is not: a second opinion decides
    return out.clone().fill_(3e38)


@pytest.mark.parametrize("corrupt", [_wrong_shape, _nan, _overflow], ids=lambda f: f.__name__[1:])
def test_a_peer_with_bad_replies_is_banned_for_the_run_and_training_goes_on(
    peers, loop_thread, corrupt
):
    run_id = f"rc-{corrupt.__name__[1:]}"
    bad, good, last = peers(run_id, 0), peers(run_id, 0), peers(run_id, 1)
    honest = bad.executor.forward
    bad.executor.forward = lambda mb, x, **kwargs: corrupt(honest(mb, x, **kwargs))

    async def body():
        async with _pipeline(last.directory, both_at=0) as pipeline:
            losses = []
            # Routing is random: the bad peer is picked within a few microbatches (never in 40: p = 2**-40).
            for i in range(40):
                tokens = torch.randint(
                    0, 256, (B, T + 1), generator=torch.Generator().manual_seed(i)
                )
                losses.append((await pipeline.train_microbatch(f"mb{i}", tokens)).loss)
                if i >= 4 and (
                    pipeline.banned_for_run
                    or bad.executor.microbatches_applied == 0
                    and pipeline.failed_calls
                ):
                    break
            return losses, set(pipeline.banned_for_run)

    losses, banned = loop_thread.run(body(), timeout_s=300)
    assert banned == (set() if corrupt is _nan else {bad.peer_id})
    assert all(torch.isfinite(torch.tensor(losses)))
    # every microbatch counted once per stage, none of them by the bad peer
    assert good.executor.microbatches_applied == last.executor.microbatches_applied == len(losses)
    assert bad.executor.microbatches_applied == 0


def test_a_peer_sending_huge_gradients_is_banned_before_they_count_anywhere(peers, loop_thread):
    """A last-stage peer whose input gradients are a million times too large (finite, well shaped) is refused by
    the trainer's gradient bound before the reply is committed: banned for the run, its microbatches go to the
    other peer, and the stage before never applies a refused gradient."""
    from swarm.outliers import MIN

    first, liar, honest = peers("rc-huge", 0), peers("rc-huge", 1), peers("rc-huge", 1)
    truthful = liar.executor.forward_loss_backward

    def huge(mb, x, targets, num_samples, params_step=None):
        loss, grad_input = truthful(mb, x, targets, num_samples, params_step)
        return loss, 1e6 * grad_input

    liar.executor.forward_loss_backward = huge

    async def body():
        async with _pipeline(first.directory, both_at=1, max_gradient_ratio=1000.0) as pipeline:
            losses = []
            for i in range(40):
                tokens = torch.randint(
                    0, 256, (B, T + 1), generator=torch.Generator().manual_seed(i)
                )
                losses.append((await pipeline.train_microbatch(f"mb{i}", tokens)).loss)
            return losses, set(pipeline.banned_for_run)

    losses, banned = loop_thread.run(body(), timeout_s=300)
    assert banned == {liar.peer_id}
    assert all(torch.isfinite(torch.tensor(losses)))
    # every microbatch counted once at each stage; the liar's only before the bound had its reference
    assert first.executor.microbatches_applied == len(losses) == 40
    assert honest.executor.microbatches_applied + liar.executor.microbatches_applied == 40
    assert liar.executor.microbatches_applied < MIN
    assert all(torch.isfinite(p).all() for p in first.executor.stage_module.parameters())


def test_closing_a_batch_counts_a_replica_that_is_gone_but_not_one_that_is_only_slow(
    peers, loop_thread
):
    """The count a trainer sends with CloseBatch tells replicas whom to step with. A replica whose connection is
    refused is gone: not counted. One that does not answer within the deadline may be busy: the trainer sends no
    count (0), so nobody is told it is alone while a live groupmate holds part of the batch (both would step on
    their own parts and the replicas would part ways)."""
    import dataclasses
    import socket

    from swarm.trainer import stagesteps as stagesteps_module

    live, last = peers("close-count", 0), peers("close-count", 1)
    seen: list[int] = []
    live.executor.close_batch = lambda batch_step, replicas=0, group=None, **_: seen.append(
        replicas
    )
    gone = socket.socket()  # bound, never listening: connections are refused
    gone.bind(("127.0.0.1", 0))
    silent = socket.socket()  # listening, never answering: calls run into their deadline
    silent.bind(("127.0.0.1", 0))
    silent.listen()

    async def body(extra: dict[str, socket.socket]) -> int:
        async with _pipeline(last.directory, both_at=0, _min_peers=1) as pipeline:
            template = pipeline.records[0][live.peer_id]
            for peer_id, sock in extra.items():
                endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
                pipeline.records[0][peer_id] = dataclasses.replace(
                    template, peer_id=peer_id, endpoint=endpoint
                )
            seen.clear()
            await pipeline.steps.close_batch([0, None])
            return seen[-1]

    old_timeout = stagesteps_module.CLOSE_BATCH_TIMEOUT_S
    stagesteps_module.CLOSE_BATCH_TIMEOUT_S = (
        1.0  # the silent one's deadline, shortened for the test
    )
    try:
        assert loop_thread.run(body({"gone": gone})) == 1
        assert loop_thread.run(body({"gone": gone, "silent": silent})) == 0
        # the only record: no sign another replica left (records expire between heartbeats on a loaded machine), so
        # no count; the replica goes by its own view of the stage (tests/test_alone_count.py)
        assert loop_thread.run(body({})) == 0
    finally:
        stagesteps_module.CLOSE_BATCH_TIMEOUT_S = old_timeout
        gone.close()
        silent.close()


@pytest.mark.parametrize("first_replicas", [1, 2])
def test_a_gradient_a_stage_refuses_costs_that_microbatch_there_never_the_run(
    peers, loop_thread, first_replicas
):
    """Peers bound the gradients they are made to compute (``max_gradient_ratio``) even when the trainer does
    not. A last-stage peer that starts sending input gradients a million times too large gets them refused by
    stage 0 (GradientOutlier). The stages after the refusing one have already counted the microbatch, so it is not
    computed again from the start: a second replica of the refusing stage decides. Refused there too, the sender is
    banned for the run; with no second replica it is not (nobody can tell who is wrong), and each refused
    microbatch counts at the last stage only. Either way training goes on and stage 0 never applies a refused
    gradient."""
    from swarm.outliers import MIN
    from swarm.peer.config import CacheConfig

    run_id = f"rc-refused-{first_replicas}"
    firsts = [
        peers(run_id, 0, cache=CacheConfig(max_gradient_ratio=1000.0))
        for _ in range(first_replicas)
    ]
    liar, honest = peers(run_id, 1), peers(run_id, 1)
    truthful, lying = liar.executor.forward_loss_backward, [False]

    def huge_once_lying(mb, x, targets, num_samples, params_step=None):
        loss, grad_input = truthful(mb, x, targets, num_samples, params_step)
        return loss, 1e6 * grad_input if lying[0] else grad_input

    liar.executor.forward_loss_backward = huge_once_lying
    warmup, lied = (
        5 * MIN * first_replicas,
        30,
    )  # every stage-0 replica has its reference before the lies

    async def body():
        async with _pipeline(firsts[0].directory, both_at=1) as pipeline:
            await pipeline.wait_for_peers(timeout_s=30)
            while len(pipeline.router.peers(0)) < first_replicas:
                await pipeline._next_refresh(timeout_s=1.0)
            for i in range(warmup + lied):
                if i == warmup:
                    lying[0] = True
                    truthful_count = liar.executor.microbatches_applied
                tokens = torch.randint(
                    0, 256, (B, T + 1), generator=torch.Generator().manual_seed(i)
                )
                result = await pipeline.train_microbatch(f"mb{i}", tokens)
                assert torch.isfinite(torch.tensor(result.loss))
            served_lying = liar.executor.microbatches_applied - truthful_count
            return pipeline, set(pipeline.banned_for_run), served_lying

    pipeline, banned, served_lying = loop_thread.run(body(), timeout_s=300)
    total = warmup + lied
    assert min(f.executor.microbatches_applied for f in firsts) >= MIN  # each had a reference
    assert liar.executor.microbatches_applied + honest.executor.microbatches_applied == total
    assert served_lying >= 1
    if first_replicas == 2:
        # refused twice, banned at once: its first lie is the only microbatch lost at stage 0
        assert banned == {liar.peer_id}
        assert pipeline.refused_gradients == pipeline.lost_gradients == served_lying == 1
    else:
        assert banned == set()
        assert pipeline.refused_gradients == pipeline.lost_gradients == served_lying
    applied_first = sum(f.executor.microbatches_applied for f in firsts)
    assert applied_first == total - pipeline.lost_gradients
