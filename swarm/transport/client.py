"""Client side of the stage protocol: one channel per peer endpoint, typed errors, deadlines on every call."""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
import torch

from swarm.compression import Codec, get_codec
from swarm.errors import (
    ERROR_METADATA_KEY,
    BadReply,
    InvalidRequest,
    SwarmError,
    TransportError,
    error_from_status,
)
from swarm.proto import PROTOCOL_VERSION
from swarm.proto import swarm_pb2 as pb
from swarm.transport.callers import CallerToken, default_token
from swarm.transport.channel import WORK_TIMEOUT_KEY
from swarm.transport.security import PeerAddress, open_channel
from swarm.transport.tensors import FrameReader, StreamLimits, tensor_frames
from swarm.transport.wire import Batch, Chunk, stage_stub

# What a caller expects of a reply: tensor name -> (shape, dtype). A reply carrying anything else is a BadReply.
Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
# A caller's own verdict on a reply's values once they passed ``expect`` (before any commit): raise InvalidRequest
# to refuse it (the caller then gets a BadReply, and the peer's gradients are never committed).
Judge = Callable[[pb.ReplyMeta, dict[str, torch.Tensor]], None]


@dataclass
class Reply:
    meta: pb.ReplyMeta
    tensors: dict[str, torch.Tensor]
    # For calls that accumulate gradients: resolves once the peer has taken our commit (the call ended
    # OK after it); raises if that cannot be confirmed. None for other calls.
    committed: asyncio.Future | None = None
    # For those calls too: the same commit through the Commit RPC (``commit_again(timeout_s)``, idempotent)
    # for when ``committed`` raised; and until when (time.monotonic()) the peer holds the gradients for it.
    commit_again: Callable[[float], Awaitable[bool]] | None = None
    hold_until: float = 0.0
    # What the commit names, PeerClient.commit's arguments before the timeout (run id, stage, microbatch id,
    # batch step): to ask the same peer at another address (swarm.trainer.commits.asked_where_it_is).
    commit_key: tuple = ()
    endpoint: str = ""  # where the call went
    # Whether the peer is gone: its address refuses connections (set by asked_where_it_is; None: not asked).
    gone: Callable[[], Awaitable[bool]] | None = None


class PeerClient:
    """Calls one peer. Every call takes a deadline; failures surface as :class:`SwarmError` subclasses."""

    def __init__(
        self,
        address: PeerAddress | str,
        *,
        token: CallerToken | None = None,
        segment_bytes: int = 1 << 20,
        limits: StreamLimits = StreamLimits(),
        commit_grace_s: float = 30.0,
    ):
        """``address``: the peer's :class:`PeerAddress` (from its signed record: TLS pinned to its certificate,
        calls authenticated for its id), or a bare endpoint for a plaintext server that checks no caller.
        ``token``: signs this caller's calls (default: a key made for this process)."""
        self.address = address if isinstance(address, PeerAddress) else PeerAddress(address)
        self.endpoint = self.address.endpoint
        self._token = token or default_token()
        # After a reply arrives, the commit round trip may take this long beyond the call's deadline: the
        # deadline bounds the work, and a slow peer that answered in time must not lose the microbatch
        # because its commit queued behind other work.
        self._commit_grace_s = commit_grace_s
        self._segment_bytes = segment_bytes
        self._limits = limits
        self._channel = open_channel(self.address)
        self._stub = stage_stub(self._channel)

    async def close(self) -> None:
        await self._channel.close(grace=None)

    def _auth(self):
        """This caller's token for the peer, in each call's metadata (see :mod:`swarm.transport.callers`)."""
        return self._token.metadata(self.address.peer_id)

    async def forward(
        self,
        meta: pb.RequestMeta,
        tensors: Sequence[tuple[str, torch.Tensor]],
        codec: Codec,
        *,
        timeout_s: float,
        expect: Expected | None = None,
        judge: Judge | None = None,
    ) -> Reply:
        """Forward; with ``meta.compute_loss`` the reply carries gradients and the call commits. With
        ``expect``, the reply is checked (see :meth:`_check_reply`) before it is used or committed."""
        return await self._stream(
            self._stub.Forward,
            meta,
            tensors,
            codec,
            timeout_s,
            commit=meta.compute_loss and not meta.eval_only and not meta.defer_commit,
            expect=expect,
            judge=judge,
        )

    async def backward(
        self,
        meta: pb.RequestMeta,
        tensors: Sequence[tuple[str, torch.Tensor]],
        codec: Codec,
        *,
        timeout_s: float,
        expect: Expected | None = None,
        judge: Judge | None = None,
    ) -> Reply:
        return await self._stream(
            self._stub.Backward,
            meta,
            tensors,
            codec,
            timeout_s,
            commit=True,
            expect=expect,
            judge=judge,
        )

    async def info(self, run_id: str = "", *, timeout_s: float) -> pb.InfoResponse:
        try:
            return await self._stub.Info(
                pb.InfoRequest(run_id=run_id), timeout=timeout_s, metadata=self._auth()
            )
        except grpc.aio.AioRpcError as e:
            raise typed_error(e, peer=self.endpoint) from None

    async def dial_back(
        self, run_id: str, endpoint: str, tls_cert: str, *, timeout_s: float
    ) -> pb.DialBackReply:
        """Ask the peer to connect to ``endpoint`` (pinning ``tls_cert``; "" = plaintext) and say whether it could
        (see :mod:`swarm.peer.reachability`)."""
        request = pb.DialBackRequest(
            protocol_version=PROTOCOL_VERSION, run_id=run_id, endpoint=endpoint, tls_cert=tls_cert
        )
        try:
            return await self._stub.DialBack(request, timeout=timeout_s, metadata=self._auth())
        except grpc.aio.AioRpcError as e:
            raise typed_error(e, peer=self.endpoint) from None

    async def get_state(
        self, run_id: str, *, include_grads: bool = False, timeout_s: float
    ) -> Reply:
        """The replica's parameters (and accumulated gradients) as ``Reply.tensors``."""
        call = self._stub.GetState(
            pb.StateRequest(run_id=run_id, include_grads=include_grads),
            timeout=timeout_s,
            metadata=self._auth(),
        )
        return await self._read(call)

    async def reduce_part(
        self, meta: pb.ReduceMeta, share: torch.Tensor, *, timeout_s: float
    ) -> torch.Tensor:
        """Send this replica's share of an all-reduce part to the part's owner (swarm.averaging.direct); its reply
        is the part's average over the group (float32, as long as the share)."""
        codec = get_codec(
            "none"
        )  # gradients travel exactly: every member takes the owner's average as it is

        async def frames() -> AsyncIterator[pb.Frame | Chunk | Batch]:
            async for frame in tensor_frames(
                "sums",
                share,
                codec,
                segment_bytes=self._segment_bytes,
                lead=[pb.Frame(reduce=meta)],
            ):
                yield frame

        call = self._stub.ReducePart(
            frames(),
            timeout=timeout_s,
            metadata=((WORK_TIMEOUT_KEY, f"{timeout_s:.3f}"), *self._auth()),
        )
        expect = {"average": ((share.numel(),), torch.float32)}
        return (await self._read(call, expect=expect)).tensors["average"]

    async def _stream(
        self,
        method,
        meta: pb.RequestMeta,
        tensors,
        codec,
        timeout_s,
        *,
        commit: bool,
        expect: Expected | None = None,
        judge: Judge | None = None,
    ) -> Reply:
        meta.num_tensors = len(tensors)
        reply_read = asyncio.Event()

        async def frames() -> AsyncIterator[pb.Frame | Chunk | Batch]:
            lead = [pb.Frame(request=meta)]  # travels with the first tensor's first chunk
            for name, tensor in tensors:
                async for frame in tensor_frames(
                    name, tensor, codec, segment_bytes=self._segment_bytes, lead=lead
                ):
                    yield frame
                lead = []
            if lead:
                yield lead[0]
            if commit:
                # Tell the peer we have its reply: only now does it count the microbatch's gradients.
                await reply_read.wait()
                if reply_ok:
                    yield pb.Frame(commit=pb.Commit(microbatch_id=meta.microbatch_id))

        metadata = ((WORK_TIMEOUT_KEY, f"{timeout_s:.3f}"), *self._auth())
        if not commit:
            call = method(frames(), timeout=timeout_s, metadata=metadata)
            return await self._read(call, expect=expect, judge=judge)
        call = method(frames(), timeout=timeout_s + self._commit_grace_s, metadata=metadata)
        reply_ok = False
        try:
            # a reply that fails the checks is never committed: the peer drops its gradients
            reply = await asyncio.wait_for(
                self._read(call, keep_open=True, expect=expect, judge=judge), timeout_s
            )
            reply_ok = True
        except asyncio.TimeoutError:
            call.cancel()  # the peer sees the cancellation and drops what it computed: no commit, no count
            raise TransportError(
                f"peer {self.endpoint}: no reply within the {timeout_s:.1f}s deadline"
            ) from None
        finally:
            reply_read.set()  # the request stream ends: with the commit after a reply, without one else
        reply.hold_until = time.monotonic() + reply.meta.commit_hold_s
        reply.committed = asyncio.ensure_future(self._confirm(call))
        reply.commit_key = (
            meta.run_id,
            meta.stage,
            meta.microbatch_id,
            meta.batch_step if meta.HasField("batch_step") else None,
        )
        reply.commit_again = functools.partial(self.commit, *reply.commit_key)
        reply.endpoint = self.endpoint
        return reply

    async def commit(
        self,
        run_id: str,
        stage: int,
        microbatch_id: str,
        batch_step: int | None,
        timeout_s: float,
    ) -> bool:
        """Commit a microbatch's held gradients through the Commit RPC: True if this applied them, False if
        an earlier commit had. Raises GradientsDropped if the peer holds none (nothing counted)."""
        request = pb.CommitRequest(
            protocol_version=PROTOCOL_VERSION,
            run_id=run_id,
            stage=stage,
            microbatch_id=microbatch_id,
        )
        if batch_step is not None:
            request.batch_step = batch_step
        try:
            reply = await self._stub.Commit(request, timeout=timeout_s, metadata=self._auth())
        except grpc.aio.AioRpcError as e:
            raise typed_error(e, peer=self.endpoint) from None
        return reply.applied_now

    async def close_batch(
        self,
        run_id: str,
        stage: int,
        batch_step: int,
        replicas: int,
        timeout_s: float,
        *,
        wait_for_step_s: float = 0.0,
        group: Sequence[PeerAddress] = (),
        group_round: int = 0,
        stage_step: int = 0,
    ) -> pb.CloseBatchReply:
        """Tell the peer this caller's part of global batch ``batch_step`` is all committed, and that ``replicas``
        replicas of the stage answered just now; returns its reply, with the peer's step: at once, or with
        ``wait_for_step_s`` once the peer has stepped past ``batch_step`` (at most that long; a peer that does not
        average answers at once). ``group``: those replicas, in the order of their all-reduce parts, ``group_round``
        the trainer's try at that group (swarm.averaging.direct), ``stage_step`` the furthest step a replica of the
        stage answered at (0: not known)."""
        request = pb.CloseBatchRequest(
            protocol_version=PROTOCOL_VERSION,
            run_id=run_id,
            stage=stage,
            batch_step=batch_step,
            replicas=replicas,
            wait_for_step_s=wait_for_step_s,
            group=[
                pb.Replica(peer_id=a.peer_id, endpoint=a.endpoint, tls_cert=a.tls_cert)
                for a in group
            ],
            group_round=group_round,
            stage_step=stage_step,
        )
        try:
            reply = await self._stub.CloseBatch(request, timeout=timeout_s, metadata=self._auth())
        except grpc.aio.AioRpcError as e:
            raise typed_error(e, peer=self.endpoint) from None
        return reply

    async def _read(
        self,
        call,
        *,
        keep_open: bool = False,
        expect: Expected | None = None,
        judge: Judge | None = None,
    ) -> Reply:
        done = False
        try:
            reader = FrameReader(call, limits=self._limits)
            meta = await reader.reply()
            check = None
            if expect is not None:
                if meta.num_tensors > len(expect):
                    raise InvalidRequest(
                        f"{meta.num_tensors} tensors announced, at most {len(expect)} expected"
                    )
                check = functools.partial(_check_header, expect)
            tensors = await reader.tensors(meta.num_tensors, check)
            if expect is not None:
                _check_values(meta, tensors)
            if judge is not None:
                judge(meta, tensors)
            if not keep_open:
                await reader.end()
            done = True
            return Reply(meta, tensors)
        except grpc.aio.AioRpcError as e:
            raise typed_error(e, peer=self.endpoint) from None
        except InvalidRequest as e:
            # A malformed or wrong reply is the peer's fault, not ours: the caller bans it and goes elsewhere.
            raise BadReply(f"peer {self.endpoint} sent a bad reply: {e}") from None
        except asyncio.CancelledError:
            _raise_if_expired(call, f"peer {self.endpoint}: no reply within the call's deadline")
            raise
        finally:
            if not done:
                call.cancel()

    async def _confirm(self, call) -> None:
        """Wait for the call to end after our commit; the peer ends it OK once it has the commit."""
        try:
            async for frame in call:
                raise TransportError(
                    f"peer {self.endpoint} sent a '{frame.WhichOneof('kind')}' frame after "
                    f"its reply"
                )
        except grpc.aio.AioRpcError as e:
            raise typed_error(e, peer=self.endpoint) from None
        except asyncio.CancelledError:
            _raise_if_expired(
                call,
                f"peer {self.endpoint}: the commit was not confirmed within the call's deadline",
            )
            raise


def cancelled_at_its_deadline(call) -> bool:
    """Whether a CancelledError out of a streaming call's reply stands for the call expiring, not for this task
    being cancelled. grpc.aio cancels a call whose request stream it finds already over when it writes the next
    frame, and the reader then raises CancelledError instead of DEADLINE_EXCEEDED. It happens when a frozen
    process (SIGSTOP, a swapped-out machine) wakes past its calls' deadlines: a trainer ended on it, instead of
    retrying elsewhere."""
    task = asyncio.current_task()
    if task is not None and getattr(task, "cancelling", lambda: 0)():
        return False  # this task is being cancelled (Python 3.11+ says so; 3.10 goes by the deadline alone)
    remaining = call.time_remaining()
    return remaining is not None and remaining <= 0


def _raise_if_expired(call, message: str) -> None:
    """Inside ``except asyncio.CancelledError`` around a streaming call's reads: the call's failure, retried
    elsewhere, when gRPC cancelled it as it expired (see :func:`cancelled_at_its_deadline`); else nothing (the
    caller re-raises the cancellation)."""
    if cancelled_at_its_deadline(call):
        raise TransportError(f"{message} (gRPC cancelled the call as it expired)") from None


def _check_header(expect: Expected, name: str, shape, dtype: torch.dtype, codec: str) -> None:
    """A reply tensor's header must be one ``expect`` names, with its shape and dtype (before allocation)."""
    if name not in expect:
        raise InvalidRequest(f"unexpected tensor '{name}' (expected {sorted(expect)})")
    want_shape, want_dtype = expect[name]
    if tuple(shape) != tuple(want_shape) or dtype != want_dtype:
        raise InvalidRequest(
            f"tensor '{name}' is {dtype} of shape {list(shape)}, expected {want_dtype} of shape "
            f"{list(want_shape)} for what was sent"
        )


def _check_values(meta: pb.ReplyMeta, tensors: dict[str, torch.Tensor]) -> None:
    """The reply's loss is finite. Its floating-point tensors are too: FrameReader decodes every tensor through
    ``Codec.decode_into``, which refuses NaN/Inf (InvalidRequest, so a BadReply here), so they are not checked a
    second time (each check is two or three torch ops on the event loop, each a GIL handoff)."""
    if meta.has_loss and not math.isfinite(meta.loss):
        raise InvalidRequest(f"the loss is {meta.loss}")


def typed_error(error: grpc.aio.AioRpcError, *, peer: str) -> SwarmError:
    """The :class:`SwarmError` a failed call stands for: the class the peer named in its trailing metadata
    (see ``swarm.transport.server.abort_with``), else the one its status code implies."""
    name = None
    for key, value in error.trailing_metadata() or ():
        if key == ERROR_METADATA_KEY and isinstance(value, str):
            name = value
    return error_from_status(error.code(), error.details(), name=name, peer=peer)


class ClientPool:
    """Reuses one :class:`PeerClient` per address (endpoint, peer id and certificate: a record naming another
    peer's endpoint gets a client of its own, which fails the TLS handshake); closes them all on :meth:`close`."""

    def __init__(self, **client_kwargs):
        self._clients: dict[PeerAddress | str, PeerClient] = {}
        self._kwargs = client_kwargs

    def get(self, address: PeerAddress | str) -> PeerClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = PeerClient(address, **self._kwargs)
        return client

    async def discard(self, address: PeerAddress | str) -> None:
        client = self._clients.pop(address, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


__all__ = ["PeerClient", "ClientPool", "Reply", "SwarmError"]
