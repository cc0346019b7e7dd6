"""Who is calling: callers sign a short-lived token, and a server interceptor admits or refuses each call.

A caller proves its identity in every call's metadata (:class:`CallerToken`): its public key, a token naming the
peer it calls and when it was made, and its signature over both. The token is bound to the callee, so a peer
that received one cannot replay it at another peer, and it is dated, so a copy is useless minutes later (TLS
keeps strangers from seeing it at all). A caller makes one token per callee and reuses it for
:data:`TOKEN_RENEW_S`; a peer checks each signature once and remembers it until the token expires.

:class:`CallerCheck` runs before any handler: a call without a valid token ends with ``UNAUTHENTICATED``
(:class:`Unauthenticated`), a caller the admission policy leaves out with ``PERMISSION_DENIED``
(:class:`NotAdmitted`), both typed so the caller knows which. The policy is open (any identified caller) unless
the peer has an allow-list (``--allow-callers``: peer ids or fingerprints).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Collection

import grpc

from swarm.errors import NotAdmitted, SwarmError, Unauthenticated
from swarm.identity import PEER_ID_HEX, Identity, fingerprint_of, peer_id_of, verify
from swarm.transport.server import abort_with, drain_request

logger = logging.getLogger(__name__)

KEY_HEADER = "swarm-caller-bin"  # the caller's public key (OpenSSH form)
TOKEN_HEADER = "swarm-token"  # "v1 <callee peer id> <issued at, unix ms>"
SIGNATURE_HEADER = "swarm-signature-bin"  # the caller's signature over key and token
_DOMAIN = b"swarm caller token v1\n"  # signed first, so no other signed swarm message can pass for a token

# A token is accepted this long after it was made, and this long before (clocks of two machines differ).
TOKEN_MAX_AGE_S = 300.0
TOKEN_MAX_EARLY_S = 60.0
# A caller makes a fresh token for a callee once its last one is this old.
TOKEN_RENEW_S = 60.0
# Valid tokens a peer remembers (their signature checked once); the oldest is forgotten first.
_VERIFIED_CACHE = 4096
# Most bytes of caller metadata looked at: a key and a signature are well under 1 KiB each.
_MAX_HEADER_BYTES = 4096


def _signed(public_key: bytes, token: bytes) -> bytes:
    return _DOMAIN + public_key + b"\n" + token


class CallerToken:
    """Makes a caller's metadata for each callee, renewed every :data:`TOKEN_RENEW_S` seconds."""

    def __init__(self, identity: Identity, clock: Callable[[], float] = time.time):
        self.identity, self._clock = identity, clock
        self._made: dict[str, tuple[float, tuple[tuple[str, str | bytes], ...]]] = {}

    def metadata(self, callee: str) -> tuple[tuple[str, str | bytes], ...]:
        """The metadata that authenticates a call to peer ``callee`` (its peer id)."""
        now = self._clock()
        made = self._made.get(callee)
        if made is None or now - made[0] >= TOKEN_RENEW_S:
            token = f"v1 {callee} {int(now * 1000)}"
            signature = self.identity.sign(_signed(self.identity.public_key, token.encode()))
            made = self._made[callee] = (
                now,
                (
                    (KEY_HEADER, self.identity.public_key),
                    (TOKEN_HEADER, token),
                    (SIGNATURE_HEADER, signature),
                ),
            )
        return made[1]


_default: CallerToken | None = None


def default_token() -> CallerToken:
    """A token maker for this process's callers that were given no identity (tests, tools): a key made on first
    use. Such a caller is identified, but by a key nobody will know again."""
    global _default
    if _default is None:
        _default = CallerToken(Identity.ephemeral())
    return _default


def caller_token(identity: Identity | None) -> CallerToken:
    """A token maker signing with ``identity``, or this process's default one when it is None."""
    return default_token() if identity is None else CallerToken(identity)


def _header(metadata, key: str):
    for k, v in metadata or ():
        if k == key:
            return v
    return None


def caller_peer_id(metadata) -> str:
    """The peer id of the caller whose call carries ``metadata``, read from its key (a server's
    :class:`CallerCheck` has verified the token before any handler runs); raises Unauthenticated if it has none."""
    key = _header(metadata, KEY_HEADER)
    if not isinstance(key, bytes):
        raise Unauthenticated(
            "the call carries no caller key: call with swarm's client, which signs one"
        )
    return peer_id_of(key)


class CallerCheck(grpc.aio.ServerInterceptor):
    """Admits a peer's calls: each must carry a valid token for ``callee`` (this peer's id) from a caller every
    policy admits: ``allowed`` (the peer's ``--allow-callers``) and ``run_allowed`` (the run owner's list, set as
    it changes). A policy that is None admits any identified caller; otherwise those whose fingerprint starts with
    one of its entries (peer ids are fingerprints' first 16 digits). ``clock``: unix seconds."""

    def __init__(
        self,
        callee: str,
        *,
        allowed: Collection[str] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.callee, self._clock = callee, clock
        self.allowed = None if allowed is None else tuple(allowed)
        self.run_allowed: tuple[str, ...] | None = (
            None  # the run owner's list (None: the run is open)
        )
        # (key, token, signature) -> when it expires: valid tokens, their signatures checked once
        self._verified: collections.OrderedDict[tuple, float] = collections.OrderedDict()
        self.refused = collections.Counter()  # class name of the error -> calls refused

    def caller(self, metadata) -> str:
        """The fingerprint of the caller whose ``metadata`` this is; raises Unauthenticated or NotAdmitted."""
        key = _header(metadata, KEY_HEADER)
        token = _header(metadata, TOKEN_HEADER)
        signature = _header(metadata, SIGNATURE_HEADER)
        if not (isinstance(key, bytes) and isinstance(token, str) and isinstance(signature, bytes)):
            raise Unauthenticated(
                "the call carries no caller token: call with swarm's client (swarm.transport.client), which "
                "signs one with your identity"
            )
        if len(key) + len(token) + len(signature) > _MAX_HEADER_BYTES:
            raise Unauthenticated(f"the caller token is over {_MAX_HEADER_BYTES} bytes")
        now = self._clock()
        entry = (key, token, signature)
        expires = self._verified.get(entry)
        if expires is None or expires < now:
            expires = self._verify(key, token, signature, now)
            self._verified[entry] = expires
            while len(self._verified) > _VERIFIED_CACHE:
                self._verified.popitem(last=False)
        fingerprint = fingerprint_of(key)
        if self.allowed is not None and not fingerprint.startswith(self.allowed):
            raise NotAdmitted(
                f"caller {fingerprint[:PEER_ID_HEX]} is not on this peer's --allow-callers list; ask the peer's "
                f"operator to add its fingerprint {fingerprint}"
            )
        if self.run_allowed is not None and not fingerprint.startswith(self.run_allowed):
            raise NotAdmitted(
                f"caller {fingerprint[:PEER_ID_HEX]} is not on the run's caller list; ask the run's owner to add "
                f"its fingerprint {fingerprint} (swarm callers --allow)"
            )
        return fingerprint

    def _verify(self, key: bytes, token: str, signature: bytes, now: float) -> float:
        """When the token expires, if it is valid now; raises Unauthenticated naming what is wrong."""
        parts = token.split(" ")
        if len(parts) != 3 or parts[0] != "v1" or not parts[2].isdigit():
            raise Unauthenticated(f"malformed caller token {token[:80]!r}")
        _, callee, issued_ms = parts
        if callee != self.callee:
            raise Unauthenticated(
                f"the caller token was made for peer {callee[:PEER_ID_HEX]!r}, not this peer "
                f"({self.callee}); a token is good at one peer only"
            )
        issued_s = int(issued_ms) / 1000
        if not now - TOKEN_MAX_AGE_S <= issued_s <= now + TOKEN_MAX_EARLY_S:
            raise Unauthenticated(
                f"the caller token is dated {issued_s - now:+.0f}s from this peer's clock (accepted: "
                f"-{TOKEN_MAX_AGE_S:.0f}s to +{TOKEN_MAX_EARLY_S:.0f}s); check the caller's clock"
            )
        if not verify(key, _signed(key, token.encode()), signature):
            raise Unauthenticated("the caller token's signature does not match its key")
        return issued_s + TOKEN_MAX_AGE_S

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        try:
            self.caller(handler_call_details.invocation_metadata)
        except (Unauthenticated, NotAdmitted) as e:
            self.refused[type(e).__name__] += 1
            return _refusal(handler, e)
        return handler


def _refusal(handler: grpc.RpcMethodHandler, error: SwarmError) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that only ends the call with ``error``."""
    kinds = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    kind = next(k for k in kinds if getattr(handler, k) is not None)
    streams_out = kind.endswith("_stream")

    async def refuse_unary(request, context):
        if kind.startswith("stream"):
            # read a little of what the caller sends, so its client sees our status (see drain_request)
            await drain_request(request, timeout_s=1.0, max_bytes=1 << 20, counted=False)
        await abort_with(context, error)

    async def refuse_stream(request, context):
        await refuse_unary(request, context)
        yield  # never reached: makes this an async generator, as a streaming handler must be

    return kinds[kind](
        refuse_stream if streams_out else refuse_unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
