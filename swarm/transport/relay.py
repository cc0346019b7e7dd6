"""swarm's own relay: a directly reachable peer lends a public port to a peer behind NAT (issue 16).

hivemind 1.1.12's p2pd cannot carry microbatches through its circuit relays (docs/nat.md), so the relayed carrier
is plain TCP spliced by a peer that callers can reach. The relayed peer's gRPC server, TLS and everything above it
are unchanged: the relay copies bytes it cannot read (the caller's TLS session ends at the relayed peer, pinned to
the certificate in that peer's signed record), so one protocol runs over two carriers.

The relay listens on one port (its *relay port*, announced in its record). Every connection to it starts with one
JSON line (at most :data:`MAX_LINE_BYTES`, within ``header_timeout_s``):

- ``{"op": "control", "key", "token", "sig"}``: a peer behind NAT asks for an endpoint. ``key``/``token``/``sig``
  are its caller token for the relay (:mod:`swarm.transport.callers`, base64 where binary), so the relay knows
  which peer id it relays for, and its admission lists apply. The relay opens a listener on a free port of its
  own for that peer and answers ``{"ok": true, "endpoint": "HOST:PORT", "keepalive_s": S}`` (or
  ``{"ok": false, "error": SENTENCE}`` and closes). The connection stays open as the control channel: the relay
  sends ``{"op": "open", "nonce": HEX}`` for each caller, and answers each ``{"op": "ping"}`` with
  ``{"op": "pong"}``. A control channel silent for 3 keepalives is closed, with its listener and connections.
- ``{"op": "data", "nonce": HEX}``: the relayed peer's fresh outbound connection for the caller the nonce names
  (sent only on the control channel, 128 random bits); from the next byte on, the relay splices it with the caller.

A caller of a peer whose control channel is gone finds the port closed (refused at once); one whose peer does not
open its data connection within ``open_timeout_s`` is disconnected. Connections are bounded (relayed at once,
handshakes in progress, relayed peers) and so are the bytes per second the relay copies.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.deadline import timeout
from swarm.errors import SwarmError
from swarm.identity import PEER_ID_HEX
from swarm.transport.callers import KEY_HEADER, SIGNATURE_HEADER, TOKEN_HEADER
from swarm.transport.relayconfig import RelayConfig

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 8192  # a caller token's JSON is ~1.5 KiB
COPY_BYTES = 1 << 16  # read size of the splice


class RelayError(SwarmError, ConnectionError):
    """A relay refused, dropped or broke the protocol; the relayed peer picks another relay."""


# ---------------------------------------------------------------------------------------------- the line protocol


async def read_message(reader: asyncio.StreamReader, *, timeout_s: float) -> dict:
    """The next JSON line; RelayError if it does not come within ``timeout_s``, the peer closed, or it is not a
    JSON object of at most :data:`MAX_LINE_BYTES`."""
    try:
        async with timeout(timeout_s):
            line = await reader.readuntil(b"\n")
    except TimeoutError:
        raise RelayError(f"nothing received within {timeout_s:g}s") from None
    except asyncio.IncompleteReadError:
        raise RelayError("the connection closed") from None
    except asyncio.LimitOverrunError:
        raise RelayError(f"a line over {MAX_LINE_BYTES} bytes") from None
    except OSError as e:
        raise RelayError(f"the connection broke: {e}") from None
    try:
        message = json.loads(line)
    except ValueError:
        raise RelayError(f"not a JSON line: {line[:60]!r}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op", "reply"), str):
        raise RelayError(f"not a relay message: {line[:60]!r}")
    return message


def write_message(writer: asyncio.StreamWriter, message: dict) -> None:
    writer.write(json.dumps(message).encode() + b"\n")


def token_message(metadata) -> dict:
    """The control request carrying a caller token (``CallerToken.metadata(relay_peer_id)``)."""
    fields = dict(metadata)
    return {
        "op": "control",
        "key": base64.b64encode(fields[KEY_HEADER]).decode(),
        "token": fields[TOKEN_HEADER],
        "sig": base64.b64encode(fields[SIGNATURE_HEADER]).decode(),
    }


def _token_metadata(message: dict):
    """The caller metadata a control request carries, for CallerCheck.caller (which judges it)."""
    try:
        return (
            (KEY_HEADER, base64.b64decode(message["key"], validate=True)),
            (TOKEN_HEADER, str(message["token"])),
            (SIGNATURE_HEADER, base64.b64decode(message["sig"], validate=True)),
        )
    except (KeyError, TypeError, ValueError, binascii.Error):
        return ()  # no token: the check says so


class ByteRate:
    """Bytes per second shared by all of a relay's splices (0 = no bound): a copy waits for its share."""

    def __init__(self, bytes_per_s: float):
        self.bytes_per_s = bytes_per_s
        self._allowance, self._at = bytes_per_s, time.monotonic()

    async def take(self, n: int) -> None:
        if self.bytes_per_s <= 0:
            return
        now = time.monotonic()
        # at most one second's worth saved up: a burst after an idle spell stays bounded
        self._allowance = min(
            self.bytes_per_s, self._allowance + (now - self._at) * self.bytes_per_s
        )
        self._at = now
        self._allowance -= n
        if self._allowance < 0:
            await asyncio.sleep(
                -self._allowance / self.bytes_per_s
            )  # the rate's wait, not a test's


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    *,
    rate: ByteRate | None = None,
    counted: Callable[[int], None] = lambda n: None,
) -> None:
    """Copy bytes both ways until either side closes or breaks, then close both."""

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(COPY_BYTES):
            if rate is not None:
                await rate.take(len(chunk))
            writer.write(chunk)
            await writer.drain()
            counted(len(chunk))

    pumps = [asyncio.ensure_future(pump(a[0], b[1])), asyncio.ensure_future(pump(b[0], a[1]))]
    try:
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in pumps:
            task.cancel()
        for task in pumps:
            with contextlib.suppress(asyncio.CancelledError, OSError, ConnectionError):
                await task
        for _, writer in (a, b):
            await close_writer(writer)


async def close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, ConnectionError, asyncio.CancelledError):
        await writer.wait_closed()


# ---------------------------------------------------------------------------------------------- the relay's side


@dataclass(eq=False)
class _Tenant:
    """One peer behind NAT this relay serves: its control channel, its public listener, its connections."""

    peer_id: str
    control: asyncio.StreamWriter
    listener: asyncio.Server | None = None
    endpoint: str = ""
    pending: dict[str, asyncio.Future] = field(default_factory=dict)  # nonce -> its data connection
    tasks: set[asyncio.Task] = field(default_factory=set)  # its callers' splices
    closed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class RelayStats:
    relayed_bytes: int = 0  # copied both ways
    connections: int = 0  # callers spliced to a relayed peer
    refused: dict[str, int] = field(default_factory=dict)  # why -> connections refused


class RelayServer:
    """The relay service of one directly reachable peer. ``authenticate(metadata)`` returns the fingerprint of a
    caller token's holder, raising a SwarmError for a bad or unadmitted one (``CallerCheck.caller``).
    ``public_host``: the address callers dial (the host of the peer's own endpoint)."""

    def __init__(
        self,
        config: RelayConfig,
        *,
        authenticate: Callable[[tuple], str],
        public_host: str,
        bind_host: str = "127.0.0.1",
    ):
        self.config, self._authenticate = config, authenticate
        self.public_host, self.bind_host = public_host, bind_host
        self._tenants: dict[str, _Tenant] = {}
        self._nonces: dict[str, _Tenant] = {}  # open requests, by nonce
        # connections that have not sent their first line yet, oldest first (a dict as an ordered set)
        self._handshakes: dict[asyncio.StreamWriter, None] = {}
        self._relayed = 0  # callers relayed now (also those waiting for their data connection)
        self._rate = ByteRate(config.relay_max_bytes_per_s)
        self._server: asyncio.Server | None = None
        self.stats = RelayStats()
        self.port = 0

    @property
    def tenants(self) -> dict[str, str]:
        """peer id -> the endpoint lent to it, for the peers relayed now."""
        return {pid: t.endpoint for pid, t in self._tenants.items()}

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(
            self._on_connection, self.bind_host, port, limit=MAX_LINE_BYTES
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for tenant in list(self._tenants.values()):
            await self._evict(tenant, "the relay stops")
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    def _refuse(self, why: str) -> None:
        self.stats.refused[why] = self.stats.refused.get(why, 0) + 1

    async def _on_connection(self, reader, writer) -> None:
        # A hostile client may open many connections and send nothing. Those still owing their first line are
        # bounded: past the bound the oldest is closed (not the newest: a relayed peer's data connection sends
        # its line at once, so a flood of silent ones cannot lock it out), and each is closed after the timeout.
        if len(self._handshakes) >= self.config.relay_max_connections:
            self._refuse("handshakes")
            oldest = next(iter(self._handshakes))
            del self._handshakes[oldest]
            oldest.transport.abort()
        self._handshakes[writer] = None
        try:
            message = await read_message(reader, timeout_s=self.config.relay_open_timeout_s)
        except RelayError as e:
            self._refuse("bad first line")
            logger.debug("relay: a connection sent no valid first line: %s", e)
            await close_writer(writer)
            return
        finally:
            self._handshakes.pop(writer, None)
        op = message.get("op")
        if op == "control":
            await self._control(message, reader, writer)
        elif op == "data":
            await self._data(message, reader, writer)
        else:
            self._refuse("bad first line")
            write_message(writer, {"ok": False, "error": f"unknown op {str(op)[:40]!r}"})
            await close_writer(writer)

    async def _control(self, message: dict, reader, writer) -> None:
        try:
            peer_id = self._authenticate(_token_metadata(message))[:PEER_ID_HEX]
        except SwarmError as e:
            self._refuse("unauthenticated")
            write_message(writer, {"ok": False, "error": str(e)})
            await close_writer(writer)
            return
        old = self._tenants.get(peer_id)
        if (
            old is not None
        ):  # the same peer again (its old channel may not have timed out yet): the new one wins
            await self._evict(old, "replaced by a new control channel")
        if len(self._tenants) >= self.config.relay_max_peers:
            self._refuse("peers")
            write_message(
                writer,
                {
                    "ok": False,
                    "error": f"this relay serves {len(self._tenants)} peers already (its "
                    f"--relay-max-peers): pick another relay",
                },
            )
            await close_writer(writer)
            return
        tenant = _Tenant(peer_id, writer)
        tenant.listener = await asyncio.start_server(
            lambda r, w: self._on_caller(tenant, r, w), self.bind_host, 0
        )
        port = tenant.listener.sockets[0].getsockname()[1]
        tenant.endpoint = (
            f"[{self.public_host}]:{port}"
            if ":" in self.public_host
            else f"{self.public_host}:{port}"
        )
        self._tenants[peer_id] = tenant
        logger.info("relay: lends %s to peer %s", tenant.endpoint, peer_id)
        write_message(
            writer,
            {"ok": True, "endpoint": tenant.endpoint, "keepalive_s": self.config.relay_keepalive_s},
        )
        why = "its control channel closed"
        try:
            while not tenant.closed.is_set():
                message = await read_message(reader, timeout_s=3 * self.config.relay_keepalive_s)
                if message.get("op") == "ping":
                    write_message(writer, {"op": "pong"})
                    await writer.drain()
        except RelayError as e:
            why = str(e)
        except (OSError, ConnectionError) as e:
            why = f"its control channel broke: {e}"
        finally:
            if self._tenants.get(peer_id) is tenant:
                await self._evict(tenant, why)

    async def _evict(self, tenant: _Tenant, why: str) -> None:
        """Stop relaying for ``tenant``: its port closes (new callers are refused at once) and its callers'
        connections end (the calls in flight fail, and their callers retry elsewhere)."""
        if tenant.closed.is_set():
            return
        tenant.closed.set()
        if self._tenants.get(tenant.peer_id) is tenant:
            del self._tenants[tenant.peer_id]
        logger.info("relay: stops relaying for peer %s (%s)", tenant.peer_id, why)
        if tenant.listener is not None:
            tenant.listener.close()
        for nonce, waiter in tenant.pending.items():
            self._nonces.pop(nonce, None)
            waiter.cancel()
        for task in list(tenant.tasks):
            task.cancel()
        await close_writer(tenant.control)

    async def _on_caller(self, tenant: _Tenant, reader, writer) -> None:
        if tenant.closed.is_set() or self._relayed >= self.config.relay_max_connections:
            self._refuse("closed" if tenant.closed.is_set() else "connections")
            await close_writer(writer)
            return
        self._relayed += 1
        task = asyncio.current_task()
        tenant.tasks.add(task)
        nonce = secrets.token_hex(16)
        waiter = asyncio.get_running_loop().create_future()
        tenant.pending[nonce], self._nonces[nonce] = waiter, tenant
        try:
            write_message(tenant.control, {"op": "open", "nonce": nonce})
            data = await asyncio.wait_for(waiter, self.config.relay_open_timeout_s)
            self.stats.connections += 1
            await splice((reader, writer), data[:2], rate=self._rate, counted=self._count)
            data[2].set()
        except (asyncio.TimeoutError, asyncio.CancelledError, OSError, ConnectionError) as e:
            if isinstance(
                e, asyncio.TimeoutError
            ):  # wait_for's (not the builtin one on Python 3.10)
                self._refuse("not opened")
                logger.info(
                    "relay: peer %s opened no connection for a caller within %gs",
                    tenant.peer_id,
                    self.config.relay_open_timeout_s,
                )
            await close_writer(writer)
        finally:
            tenant.pending.pop(nonce, None)
            self._nonces.pop(nonce, None)
            tenant.tasks.discard(task)
            self._relayed -= 1

    def _count(self, n: int) -> None:
        self.stats.relayed_bytes += n

    async def _data(self, message: dict, reader, writer) -> None:
        nonce = message.get("nonce")
        tenant = self._nonces.pop(nonce, None) if isinstance(nonce, str) else None
        waiter = tenant.pending.pop(nonce, None) if tenant is not None else None
        if waiter is None or waiter.done():
            self._refuse("unknown nonce")
            await close_writer(writer)
            return
        done = asyncio.Event()
        waiter.set_result((reader, writer, done))
        # the caller's task splices this connection and closes it; this handler only waits for that
        with contextlib.suppress(asyncio.CancelledError):
            await _either(done, tenant.closed)
        await close_writer(writer)


async def _either(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
