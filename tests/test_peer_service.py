"""A real peer (real DHT, real gRPC server) answers bad input with a clear status and loses nothing."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from swarm.compression import get_codec
from swarm.config import RunConfig
from swarm.discovery.dht import DHTConfig
from swarm.errors import GradientsDropped, InvalidRequest, NotCached, WrongPeer
from swarm.model import ModelConfig, build_stage
from swarm.peer.config import PeerConfig
from swarm.peer.lifecycle import Peer
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.states import PeerState
from swarm.transport.callers import default_token
from swarm.transport.client import PeerClient
from swarm.transport.security import PeerAddress, open_channel
from swarm.transport.tensors import FrameReader, tensor_frames
from swarm.transport.wire import stage_stub

pytestmark = pytest.mark.integration

MODEL = ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16, num_stages=2)
RUN = RunConfig(model=MODEL, target_batch_size=10_000)  # never steps: gradients only accumulate
B, T, D = 2, 16, 32
NONE = get_codec("none")


@pytest.fixture(scope="module")
def peers(loop_thread):
    async def start():
        last = await Peer.create(PeerConfig(run_id="t", stage=1, metrics_port=0), run=RUN)
        first = await Peer.create(
            PeerConfig(run_id="t", stage=0, dht=DHTConfig(initial_peers=tuple(last.addresses())))
        )
        return first, last

    first, last = loop_thread.run(start())
    yield first, last
    loop_thread.run(first.shutdown())
    loop_thread.run(last.shutdown())


def auth(address: PeerAddress):
    """The metadata that authenticates this test process's calls to ``address``."""
    return default_token().metadata(address.peer_id)


def meta(stage=1, **kw) -> pb.RequestMeta:
    kw.setdefault("microbatch_id", "mb")
    return pb.RequestMeta(
        protocol_version=kw.pop("protocol_version", PROTOCOL_VERSION),
        run_id=kw.pop("run_id", "t"),
        stage=stage,
        codec=kw.pop("codec", "none"),
        **kw,
    )


def hidden(seed=0):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def targets():
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))


async def state(peer: Peer):
    reply = await PeerClient(peer.address).get_state("t", include_grads=True, timeout_s=10)
    return reply.meta.samples_accumulated, {
        k: v for k, v in reply.tensors.items() if k.startswith("grad/")
    }


async def raw_call(address: PeerAddress, frames: list[pb.Frame], method="Forward", auth_=True):
    """Send exactly these frames (possibly malformed), with this process's caller token unless ``auth_`` is
    False, and return (status code, details)."""
    async with open_channel(address) as channel:
        stub = stage_stub(channel)

        async def gen():
            for f in frames:
                yield f

        try:
            metadata = auth(address) if auth_ else ()
            async for _ in getattr(stub, method)(gen(), timeout=10, metadata=metadata):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


async def frames_of(m: pb.RequestMeta, *tensors) -> list[pb.Frame]:
    if not m.num_tensors:
        m.num_tensors = len(tensors)
    out = [pb.Frame(request=m)]
    for name, t in tensors:
        out += [f async for f in tensor_frames(name, t, NONE)]
    return out


async def loss_call(peer, mb_id, x=None):
    """A well-formed last-stage call, committed: its gradients count once this returns."""
    client = PeerClient(peer.address)
    reply = await client.forward(
        meta(microbatch_id=mb_id, compute_loss=True, num_samples=B),
        [("input", hidden() if x is None else x), ("targets", targets())],
        NONE,
        timeout_s=30,
    )
    await reply.committed
    return reply


def reference_gradients(stage_index: int, objective) -> dict[str, torch.Tensor]:
    """Parameter gradients of ``objective(stage_module)`` on a fresh copy of the stage (the peers never step,
    so theirs equal it), named as GetState names them."""
    stage_module = build_stage(MODEL, stage_index)
    objective(stage_module).backward()
    return {f"grad/{n}": p.grad for n, p in stage_module.named_parameters() if p.grad is not None}


def assert_accumulated(before: dict, after: dict, expected: dict) -> None:
    """The accumulated gradients grew by exactly ``expected`` (to float32 summation)."""
    assert expected.keys() <= after.keys()
    for name, grad in after.items():
        added = grad - before[name]
        want = expected.get(name, torch.zeros_like(grad))
        torch.testing.assert_close(added, want, rtol=1e-4, atol=1e-6, msg=name)


def test_valid_loss_call_accumulates(peers, loop_thread):
    _, last = peers

    async def body():
        before = await state(last)
        reply = await loss_call(last, "valid-1")
        after = await state(last)
        return before, reply, after

    (before, grads_before), reply, (after, grads) = loop_thread.run(body())
    x = hidden().requires_grad_()
    loss = build_stage(MODEL, 1).loss(x, targets())
    assert reply.meta.has_loss and reply.meta.loss == pytest.approx(loss.item(), rel=1e-5)
    assert reply.meta.compute_s > 0
    # The peer accumulates gradient sums: the loss weighted by the call's samples.
    expected = reference_gradients(1, lambda stage: stage.loss(x, targets()) * B)
    (grad_input,) = torch.autograd.grad(loss * B, x)
    torch.testing.assert_close(reply.tensors["grad_input"], grad_input, rtol=1e-4, atol=1e-6)
    assert after == before + B
    assert_accumulated(grads_before, grads, expected)


def _bad_cases():
    x = hidden()
    bad_width = torch.randn(B, T, D - 1)
    nan_x = hidden().clone()
    nan_x[0, 0, 0] = float("nan")
    return {
        "wrong run": (
            lambda: frames_of(
                meta(run_id="other", compute_loss=True), ("input", x), ("targets", targets())
            ),
            grpc.StatusCode.NOT_FOUND,
            "serves run 't'",
        ),
        "wrong stage": (
            lambda: frames_of(
                meta(stage=0, compute_loss=True), ("input", x), ("targets", targets())
            ),
            grpc.StatusCode.NOT_FOUND,
            "serves stage 1",
        ),
        "old protocol": (
            lambda: frames_of(meta(protocol_version=999, compute_loss=True), ("input", x)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "protocol version 999",
        ),
        "wrong width": (
            lambda: frames_of(
                meta(compute_loss=True), ("input", bad_width), ("targets", targets())
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "shape [2, 16, 31] does not fit stage 1",
        ),
        "wrong dtype": (
            lambda: frames_of(
                meta(compute_loss=True), ("input", x.double()), ("targets", targets())
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "float64",
        ),
        "wrong rank": (
            lambda: frames_of(meta(compute_loss=True), ("input", x[0]), ("targets", targets())),
            grpc.StatusCode.INVALID_ARGUMENT,
            "3 dims",
        ),
        "unknown codec": (
            lambda: frames_of(meta(codec="zstd9", compute_loss=True), ("input", x)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "zstd9",
        ),
        "NaN input": (
            lambda: _raw_tensor(meta(compute_loss=True), "input", nan_x),
            grpc.StatusCode.INVALID_ARGUMENT,
            "NaN",
        ),
        "targets out of range": (
            lambda: frames_of(meta(compute_loss=True), ("input", x), ("targets", targets() + 300)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "[0, 256)",
        ),
        "missing targets": (
            lambda: frames_of(meta(compute_loss=True), ("input", x)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "targets",
        ),
        "too many tensors": (
            lambda: frames_of(meta(compute_loss=True, num_tensors=9), ("input", x)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "announces 9 tensors",
        ),
        # Its own id: the gradients it computed stay held for a commit (Commit RPC) until the hold ends, and a
        # call with the same id meanwhile is taken for a retry of this one.
        "no commit": (
            lambda: frames_of(
                meta(microbatch_id="no-commit", compute_loss=True),
                ("input", x),
                ("targets", targets()),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "commit",
        ),
        "no request frame": (
            lambda: _async([pb.Frame(chunk=b"xx")]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request",
        ),
        "truncated stream": (
            lambda: _truncated(x),
            grpc.StatusCode.INVALID_ARGUMENT,
            "ended early",
        ),
        "garbage payload": (lambda: _garbage(x), grpc.StatusCode.INVALID_ARGUMENT, "bytes"),
        "oversized batch": (
            lambda: frames_of(meta(compute_loss=True), ("input", torch.zeros(1000, T, D))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "more than the 256",
        ),
    }


async def _async(value):
    return value


async def _raw_tensor(m, name, t):
    """Frames carrying ``t`` as raw bytes, bypassing the sender-side checks a well-behaved client runs."""
    header = pb.TensorHeader(
        name=name, dtype="float32", shape=list(t.shape), codec="none", segment_numel=t.numel()
    )
    m.num_tensors = 1
    return [pb.Frame(request=m), pb.Frame(tensor=header), pb.Frame(chunk=t.numpy().tobytes())]


async def _truncated(x):
    frames = await frames_of(meta(compute_loss=True), ("input", x.repeat(64, 1, 1)[:64]))
    return frames[:-1]  # the last chunk never comes


async def _garbage(x):
    frames = await frames_of(meta(compute_loss=True), ("input", x))
    frames[2] = pb.Frame(chunk=b"\x07" * 1001)
    return frames


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_input_gets_clear_error_and_loses_nothing(peers, loop_thread, case):
    _, last = peers
    make_frames, code, needle = _bad_cases()[case]

    async def body():
        before = await state(last)
        got = await raw_call(last.address, await make_frames())
        after = await state(last)
        still_serving = await loss_call(last, f"after-{case}")
        return before, got, after, still_serving

    before, (got_code, details), after, ok = loop_thread.run(body())
    assert got_code == code, details
    assert needle in details, details
    assert after[0] == before[0], "a rejected request changed the accumulated sample count"
    for name, grad in before[1].items():
        assert torch.equal(grad, after[1][name]), f"a rejected request touched {name}"
    assert ok.meta.has_loss  # the peer keeps serving


def test_stage0_rejects_bad_token_ids(peers, loop_thread):
    first, _ = peers
    tokens = torch.full((B, T), 256, dtype=torch.int64)

    async def body():
        await PeerClient(first.address).forward(
            meta(stage=0), [("input", tokens)], NONE, timeout_s=10
        )

    with pytest.raises(InvalidRequest, match=r"token ids in \[256, 256\]"):
        loop_thread.run(body())


def test_backward_without_cache_asks_for_inputs_and_counts_once(peers, loop_thread):
    first, _ = peers
    tokens = torch.randint(0, 256, (B, T))
    grad = torch.randn(B, T, D)

    async def body():
        client = PeerClient(first.address)
        with pytest.raises(NotCached, match="resend it with its inputs"):
            await client.backward(
                meta(stage=0, microbatch_id="nc"), [("grad_output", grad)], NONE, timeout_s=10
            )
        before, _ = await state(first)
        m = meta(stage=0, microbatch_id="nc", include_inputs=True)
        await (
            await client.backward(m, [("grad_output", grad), ("input", tokens)], NONE, timeout_s=10)
        ).committed
        once, grads_once = await state(first)
        retry = await client.backward(
            m, [("grad_output", grad), ("input", tokens)], NONE, timeout_s=10
        )
        await retry.committed
        twice, grads_twice = await state(first)
        return before, once, twice, grads_once, grads_twice

    before, once, twice, g1, g2 = loop_thread.run(body())
    assert once == before + B and twice == once
    assert all(torch.equal(g1[k], g2[k]) for k in g1)


def test_forward_then_backward_uses_cache(peers, loop_thread):
    first, _ = peers
    tokens = torch.randint(0, 256, (B, T))

    async def body():
        before = await state(first)
        client = PeerClient(first.address)
        out = await client.forward(
            meta(stage=0, microbatch_id="fb"), [("input", tokens)], NONE, timeout_s=10
        )
        h = out.tensors["output"]
        # no inputs sent: the peer answers from what it kept at the forward
        reply = await client.backward(
            meta(stage=0, microbatch_id="fb"),
            [("grad_output", torch.ones_like(h))],
            NONE,
            timeout_s=10,
        )
        await reply.committed
        return before, out, reply, await state(first)

    (samples_before, grads_before), out, reply, (samples, grads) = loop_thread.run(body())
    h = out.tensors["output"]
    torch.testing.assert_close(h, build_stage(MODEL, 0)(tokens), rtol=1e-5, atol=1e-6)
    # Each reply reports the seconds its own compute took (the caller's routing weighs peers by it).
    assert out.meta.compute_s > 0 and reply.meta.compute_s > 0
    assert "grad_input" not in reply.tensors  # stage 0's input is token ids
    assert samples == samples_before + B
    assert_accumulated(grads_before, grads, reference_gradients(0, lambda s: s(tokens).sum()))


def test_info_and_wrong_run(peers, loop_thread):
    first, last = peers

    async def info(run_id):
        return await PeerClient(last.address).info(run_id, timeout_s=10)

    got = loop_thread.run(info("t"))
    assert got.stage == 1 and got.state == PeerState.SERVING and "int8" in got.codecs
    with pytest.raises(WrongPeer, match="serves run 't', not 'nope'"):
        loop_thread.run(info("nope"))


async def reply_then_break(peer: Peer, microbatch_id: str, x: torch.Tensor):
    """A last-stage loss call whose caller reads the whole reply, then loses the call before its commit
    frame leaves (the stream is cancelled). Returns the reply's meta."""
    frames = await frames_of(
        meta(microbatch_id=microbatch_id, compute_loss=True, num_samples=B),
        ("input", x),
        ("targets", targets()),
    )
    lost = asyncio.Event()

    async def gen():
        for f in frames:
            yield f
        await lost.wait()  # the commit frame never comes

    async with open_channel(peer.address) as channel:
        call = stage_stub(channel).Forward(gen(), timeout=30, metadata=auth(peer.address))
        reader = FrameReader(call)
        got = await reader.reply()
        assert set(await reader.tensors(got.num_tensors)) == {"grad_input"}
        call.cancel()
        lost.set()  # the request stream ends too (no task of it left pending)
    return got


def test_a_call_lost_after_its_reply_commits_once_through_the_commit_rpc(peers, loop_thread):
    _, last = peers
    x = hidden(7)

    async def body():
        samples_before, grads_before = await state(last)
        got = await reply_then_break(last, "lost", x)
        not_yet = await state(last)
        client = PeerClient(last.address)
        try:
            first = await client.commit("t", 1, "lost", None, timeout_s=10)
            again = await client.commit("t", 1, "lost", None, timeout_s=10)
            with pytest.raises(GradientsDropped, match="none were computed here"):
                await client.commit("t", 1, "never-computed", None, timeout_s=10)
            with pytest.raises(WrongPeer, match="not stage 0"):
                await client.commit("t", 0, "lost", None, timeout_s=10)
        finally:
            await client.close()
        return samples_before, grads_before, got, not_yet, first, again, await state(last)

    samples_before, grads_before, got, not_yet, first, again, (samples, grads) = loop_thread.run(
        body()
    )
    # The reply states the hold the caller has to commit in; without a commit nothing counted yet.
    assert got.commit_hold_s == last.config.cache.commit_hold_s > 0
    assert not_yet[0] == samples_before
    # The Commit RPC applied it (true), a repeat found it applied (false): counted once, exactly the
    # microbatch's gradient.
    assert (first, again) == (True, False)
    assert samples == samples_before + B
    assert_accumulated(
        grads_before, grads, reference_gradients(1, lambda s: s.loss(x, targets()) * B)
    )


def scrape(peer: Peer) -> dict[tuple[str, tuple], float]:
    """The peer's /metrics, parsed by Prometheus' own text parser: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(
        f"http://127.0.0.1:{peer.metrics_port}/metrics", timeout=10
    ) as page:
        text = page.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_parse_and_move_with_the_calls_served(peers, loop_thread):
    _, last = peers
    me = (("peer_id", last.peer_id), ("run_id", "t"))

    def value(name, **labels):
        return scrape(last)[(name, tuple(sorted({**dict(me), **labels}.items())))]

    def calls(method, outcome="ok"):
        key = ("swarm_peer_calls_total", (("method", method), ("outcome", outcome)))
        return scrape(last).get(key, 0.0)

    before = {
        "applied": value("swarm_peer_microbatches_applied_total"),
        "samples": value("swarm_peer_samples_applied_total"),
        "forward": calls("Forward"),
        "refused": calls("Forward", "InvalidRequest"),
        # absent until the first Forward call (this test may run first)
        "count": scrape(last).get(("swarm_peer_call_seconds_count", (("method", "Forward"),)), 0.0),
        "unauthenticated": value("swarm_peer_calls_refused_total", why="Unauthenticated"),
    }

    async def body():
        for i in range(3):
            await loss_call(last, f"metrics-{i}")
        with pytest.raises(InvalidRequest):
            await PeerClient(last.address).forward(
                meta(microbatch_id="metrics-bad", compute_loss=True),
                [("input", hidden())],
                NONE,
                timeout_s=10,
            )
        # a call without a caller token never reaches a handler: counted apart
        code, _ = await raw_call(
            last.address, [pb.Frame(request=meta())], method="Forward", auth_=False
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED

    loop_thread.run(body())
    assert (
        value("swarm_peer_calls_refused_total", why="Unauthenticated")
        == before["unauthenticated"] + 1
    )
    assert value("swarm_peer_microbatches_applied_total") == before["applied"] + 3
    assert value("swarm_peer_samples_applied_total") == before["samples"] + 3 * B
    assert calls("Forward") == before["forward"] + 3
    assert calls("Forward", "InvalidRequest") == before["refused"] + 1
    assert (
        scrape(last)[("swarm_peer_call_seconds_count", (("method", "Forward"),))]
        == before["count"] + 4
    )
    assert value("swarm_peer_stage") == 1 and value("swarm_peer_state", state="serving") == 1.0
    assert value("swarm_peer_state", state="draining") == 0.0
    assert value("swarm_peer_busy_seconds_total") > 0
    assert scrape(last)[("process_resident_memory_bytes", ())] > 0


def test_a_peer_sums_up_what_it_did_in_one_log_line(peers, loop_thread):
    _, last = peers
    line = last.summary()
    assert line.startswith(f"peer {last.peer_id} stage 1 serving: step 0, ")
    before = last.executor.microbatches_applied

    async def work():
        for i in range(2):
            await loss_call(last, f"summary-{i}")

    loop_thread.run(work())
    line = last.summary()
    # since the last summary: 2 microbatches of B samples, at some positive rate; the counts are the peer's
    rate = float(re.search(r"([\d.]+) samples/s applied over", line).group(1))
    assert rate > 0 and f"({before + 2} microbatches in all)" in line, line
    assert re.search(
        r"busy \d+%, in flight 0, held gradients \d+, dropped \d+, backwards from a kept graph \d+ / "
        r"recomputed \d+$",
        line,
    ), line
