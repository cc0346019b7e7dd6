"""A real `swarm peer` process attacked as an outsider would: calls without a token, with forged, misdirected,
stale or oversized ones, over a channel pinned to another certificate or none, idle streams and wrong shapes from
an identified caller, and callers an allow-list leaves out. Each attack is refused with its typed status, nothing
it sent counts, and an honest caller (pinned to the certificate the peer's signed record names) is still served."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from swarm.compression import get_codec
from swarm.coordinator.localswarm import read_peer_addresses, wait_ready
from swarm.discovery.dht import DHTConfig, RunDirectory, start_dht
from swarm.errors import ERROR_METADATA_KEY, NotAdmitted, TransportError, Unauthenticated
from swarm.identity import Identity
from swarm.model import MODEL_PRESETS
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.transport import callers
from swarm.transport.callers import CallerToken
from swarm.transport.client import PeerClient
from swarm.transport.security import PeerAddress, make_certificate, open_channel
from swarm.transport.tensors import tensor_frames
from swarm.transport.wire import stage_stub

pytestmark = pytest.mark.swarm

RUN_ID = "adversarial"
TINY = MODEL_PRESETS["tiny"]
B = 2
NONE = get_codec("none")
# never steps (so a counted gradient shows in Info), and cuts a silent stream after 2 s
FLAGS = [
    "--preset",
    "tiny",
    "--target-batch-size",
    "1000000",
    "--no-average",
    "--no-rebalance",
    "--read-idle-s",
    "2",
]
HONEST, STRANGER = Identity.ephemeral(), Identity.ephemeral()


@pytest.fixture(scope="module")
def dht(module_swarm):
    node = start_dht(DHTConfig(initial_peers=tuple(module_swarm.addresses())), client_mode=True)
    yield node
    node.shutdown()


def _start(swarm, dht, name: str, stage: int, *flags) -> tuple[object, PeerAddress]:
    """Start a peer process; its address as its signed record announces it."""
    proc = swarm.peer(name, stage, *FLAGS, *flags, run_id=RUN_ID)
    endpoint = wait_ready(proc)
    (address,) = asyncio.run(read_peer_addresses(RunDirectory(dht, RUN_ID), [endpoint]))
    assert address.tls_cert and address.peer_id  # TLS is on by default
    return proc, address


@pytest.fixture(scope="module")
def victim(module_swarm, dht):
    return _start(module_swarm, dht, "victim", 1)


def loss_meta(microbatch_id: str) -> pb.RequestMeta:
    return pb.RequestMeta(
        protocol_version=PROTOCOL_VERSION,
        run_id=RUN_ID,
        stage=1,
        codec="none",
        microbatch_id=microbatch_id,
        num_samples=B,
        compute_loss=True,
    )


def loss_inputs(seed: int = 0, width: int = TINY.d_model):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(B, TINY.seq_len, width, generator=generator)  # (B, T, D)
    targets = torch.randint(0, 256, (B, TINY.seq_len), generator=generator)  # (B, T)
    return [("input", x), ("targets", targets)]


async def loss_frames(microbatch_id: str, **kw) -> list[pb.Frame]:
    frames = [pb.Frame(request=loss_meta(microbatch_id))]
    frames[0].request.num_tensors = 2
    for name, tensor in loss_inputs(**kw):
        frames += [f async for f in tensor_frames(name, tensor, NONE)]
    return frames


async def honest_loss_call(address: PeerAddress, microbatch_id: str) -> float:
    client = PeerClient(address, token=CallerToken(HONEST))
    try:
        reply = await client.forward(loss_meta(microbatch_id), loss_inputs(), NONE, timeout_s=60)
        await reply.committed
        return reply.meta.loss
    finally:
        await client.close()


async def applied(address: PeerAddress) -> int:
    client = PeerClient(address, token=CallerToken(HONEST))
    try:
        return (await client.info(RUN_ID, timeout_s=30)).microbatches_applied
    finally:
        await client.close()


async def raw(
    address: PeerAddress, method: str, request, metadata=(), hold: asyncio.Event | None = None
):
    """One call with exactly ``metadata``: (status code, the error class the peer named)."""

    async def frames():
        for frame in request:
            yield frame
        if hold is not None:
            await hold.wait()

    async with open_channel(address) as channel:
        stub = stage_stub(channel)
        call = getattr(stub, method)
        try:
            if method in ("Forward", "Backward"):
                async for _ in call(frames(), timeout=60, metadata=metadata):
                    pass
            elif method == "GetState":
                async for _ in call(request, timeout=60, metadata=metadata):
                    pass
            else:
                await call(request, timeout=60, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            names = [v for k, v in e.trailing_metadata() or () if k == ERROR_METADATA_KEY]
            return e.code(), names[0] if names else None
    return grpc.StatusCode.OK, None


def forged(address: PeerAddress) -> dict[str, tuple]:
    """Metadata an attacker can make, by what is wrong with it."""
    mine = CallerToken(STRANGER).metadata(address.peer_id)
    swap = dict(mine)
    return {
        "none": (),
        "someone else's key": (
            (callers.KEY_HEADER, HONEST.public_key),
            (callers.TOKEN_HEADER, swap[callers.TOKEN_HEADER]),
            (callers.SIGNATURE_HEADER, swap[callers.SIGNATURE_HEADER]),
        ),
        "made for another peer": CallerToken(STRANGER).metadata("fedcba9876543210"),
        "stale": CallerToken(STRANGER, clock=lambda: 1_000_000_000.0).metadata(address.peer_id),
        "oversized": (
            (callers.KEY_HEADER, b"k" * 6000),
            (callers.TOKEN_HEADER, swap[callers.TOKEN_HEADER]),
            (callers.SIGNATURE_HEADER, swap[callers.SIGNATURE_HEADER]),
        ),
    }


def test_calls_without_a_valid_token_are_refused_and_count_nothing(victim):
    proc, address = victim

    async def body():
        assert await honest_loss_call(address, "honest-0") > 0
        before = await applied(address)
        requests = {
            "Info": pb.InfoRequest(run_id=RUN_ID),
            "GetState": pb.StateRequest(run_id=RUN_ID),
            "Commit": pb.CommitRequest(
                protocol_version=PROTOCOL_VERSION, run_id=RUN_ID, stage=1, microbatch_id="honest-0"
            ),
            "CloseBatch": pb.CloseBatchRequest(
                protocol_version=PROTOCOL_VERSION, run_id=RUN_ID, stage=1, batch_step=0
            ),
            "Forward": await loss_frames("attack"),
            "Backward": await loss_frames("attack-bw"),
        }
        outcomes = {}
        for why, metadata in forged(address).items():
            for method, request in requests.items():
                outcomes[why, method] = await raw(address, method, request, metadata)
        # a flood of them at once, each with a whole request behind it
        flood = await asyncio.gather(
            *(raw(address, "Forward", requests["Forward"]) for _ in range(32))
        )
        return before, outcomes, flood, await applied(address)

    before, outcomes, flood, after = asyncio.run(body())
    wrong = {
        k: v
        for k, v in outcomes.items()
        if v != (grpc.StatusCode.UNAUTHENTICATED, "Unauthenticated")
    }
    assert not wrong, wrong
    assert set(flood) == {(grpc.StatusCode.UNAUTHENTICATED, "Unauthenticated")}
    assert after == before  # no refused gradient was counted
    assert asyncio.run(honest_loss_call(address, "honest-1")) > 0
    assert asyncio.run(applied(address)) == before + 1
    assert proc.alive()


def test_the_clients_typed_errors_and_a_channel_pinned_to_another_certificate(victim):
    _, address = victim

    async def info(address: PeerAddress, identity: Identity = HONEST):
        client = PeerClient(address, token=CallerToken(identity))
        try:
            return await client.info(RUN_ID, timeout_s=10)
        finally:
            await client.close()

    # calling without knowing the peer's id: the token names nobody, and the peer says so
    with pytest.raises(Unauthenticated, match="not this peer"):
        asyncio.run(info(PeerAddress(address.endpoint, "", address.tls_cert)))
    # a man in the middle's certificate, or none: no connection at all
    impostor = PeerAddress(address.endpoint, address.peer_id, make_certificate(STRANGER))
    for wrong in (impostor, PeerAddress(address.endpoint, address.peer_id, "")):
        with pytest.raises(TransportError) as caught:
            asyncio.run(info(wrong))
        assert caught.value.status == grpc.StatusCode.UNAVAILABLE
    assert asyncio.run(info(address)).stage == 1


def test_an_identified_caller_still_meets_the_bounds(victim):
    proc, address = victim

    async def body():
        metadata = CallerToken(STRANGER).metadata(address.peer_id)
        never = asyncio.Event()
        idle = raw(address, "Forward", (await loss_frames("idle"))[:1], metadata, hold=never)
        narrow = raw(address, "Forward", await loss_frames("narrow", width=64), metadata)
        return await asyncio.gather(idle, narrow)

    idle, narrow = asyncio.run(body())
    assert idle == (grpc.StatusCode.DEADLINE_EXCEEDED, "StreamTimeout")  # --read-idle-s 2
    assert narrow == (grpc.StatusCode.INVALID_ARGUMENT, "InvalidRequest")
    assert asyncio.run(honest_loss_call(address, "honest-2")) > 0
    assert proc.alive()


def test_an_allow_list_admits_its_callers_only(module_swarm, dht):
    _, address = _start(module_swarm, dht, "guarded", 0, "--allow-callers", HONEST.peer_id)

    async def info(identity: Identity):
        client = PeerClient(address, token=CallerToken(identity))
        try:
            return await client.info(RUN_ID, timeout_s=10)
        finally:
            await client.close()

    assert asyncio.run(info(HONEST)).stage == 0
    with pytest.raises(NotAdmitted, match=STRANGER.fingerprint):
        asyncio.run(info(STRANGER))
