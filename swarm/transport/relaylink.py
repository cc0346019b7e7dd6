"""The relayed peer's side of swarm's relay (:mod:`swarm.transport.relay`): one control channel to one relay.

A peer behind NAT dials out to a relay's relay port, proves its identity with a caller token for the relay, and
gets an endpoint on the relay that it announces as its own. For each caller the relay sends an ``open``; the link
dials the relay again (outbound, so NAT lets it through), names the nonce, and splices that connection into the
peer's own gRPC server on this host. The peer's TLS is untouched: the caller's handshake reaches the peer's server
through two splices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from swarm.deadline import timeout
from swarm.transport.callers import CallerToken
from swarm.transport.relay import (
    MAX_LINE_BYTES,
    RelayError,
    close_writer,
    read_message,
    splice,
    token_message,
    write_message,
)

logger = logging.getLogger(__name__)


class RelayLink:
    """A control channel to the relay at ``relay_host:relay_port`` (peer ``relay_peer_id``), forwarding callers
    to the local server at ``local_host:local_port``. ``await link.open()`` returns the endpoint lent; ``await
    link.serve()`` serves callers until the channel is lost and returns why (a sentence)."""

    def __init__(
        self,
        *,
        relay_host: str,
        relay_port: int,
        relay_peer_id: str,
        token: CallerToken,
        local_host: str,
        local_port: int,
        timeout_s: float = 10.0,
    ):
        self.relay_host, self.relay_port, self.relay_peer_id = relay_host, relay_port, relay_peer_id
        self._token, self._timeout_s = token, timeout_s
        self.local_host, self.local_port = local_host, local_port
        self.endpoint = ""
        self.keepalive_s = 5.0
        # when (time.monotonic) the relay was last heard on the control channel: it answers each keepalive
        self.heard_at = 0.0
        self.connections = 0  # callers spliced into the local server
        self._control: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._tasks: set[asyncio.Task] = set()

    async def open(self) -> str:
        """Ask the relay for an endpoint; RelayError (a sentence) if it cannot be reached or refuses."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.relay_host, self.relay_port, limit=MAX_LINE_BYTES),
                self._timeout_s,
            )
        except (OSError, asyncio.TimeoutError) as e:
            raise RelayError(
                f"relay {self.relay_peer_id} at {self.relay_host}:{self.relay_port} cannot be reached: "
                f"{e or type(e).__name__}"
            ) from None
        try:
            write_message(writer, token_message(self._token.metadata(self.relay_peer_id)))
            await writer.drain()
            reply = await read_message(reader, timeout_s=self._timeout_s)
        except (RelayError, OSError) as e:
            await close_writer(writer)
            raise RelayError(f"relay {self.relay_peer_id} did not answer: {e}") from None
        endpoint, keepalive_s = reply.get("endpoint"), reply.get("keepalive_s")
        if not reply.get("ok") or not isinstance(endpoint, str) or ":" not in endpoint:
            await close_writer(writer)
            raise RelayError(
                f"relay {self.relay_peer_id} refused: {str(reply.get('error', reply))[:300]}"
            )
        if isinstance(keepalive_s, int | float) and 0 < keepalive_s <= 60:
            self.keepalive_s = float(keepalive_s)
        self.endpoint, self._control = endpoint, (reader, writer)
        self.heard_at = time.monotonic()
        return endpoint

    async def serve(self) -> str:
        """Forward the relay's callers until the control channel is lost; why it was (a sentence)."""
        reader, writer = self._control
        pinger = asyncio.ensure_future(self._ping(writer))
        try:
            while True:
                message = await read_message(reader, timeout_s=3 * self.keepalive_s)
                self.heard_at = time.monotonic()
                if message.get("op") == "open" and isinstance(message.get("nonce"), str):
                    task = asyncio.ensure_future(self._forward(message["nonce"][:64]))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        except RelayError as e:
            return f"the control channel to relay {self.relay_peer_id} was lost: {e}"
        finally:
            pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pinger
            await close_writer(writer)

    def in_doubt(self) -> bool:
        """Whether the relay may have closed the port it lent without this side knowing yet: it was last heard more
        than two keepalives ago (it answers each one, and drops a tenant silent for three). A process frozen past
        that (SIGSTOP, a stalled host) thaws with its control channel's end still unread."""
        return time.monotonic() - self.heard_at > 2 * self.keepalive_s

    async def close(self) -> None:
        """Close the control channel and every forwarded connection."""
        if self._control is not None:
            await close_writer(self._control[1])
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _ping(self, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                await asyncio.sleep(self.keepalive_s)  # the keepalive period
                write_message(writer, {"op": "ping"})
                await writer.drain()

    async def _forward(self, nonce: str) -> None:
        """One caller: a data connection to the relay naming ``nonce``, spliced into the local server."""
        relayed = local = None
        try:
            async with timeout(self._timeout_s):
                relayed = await asyncio.open_connection(self.relay_host, self.relay_port)
                write_message(relayed[1], {"op": "data", "nonce": nonce})
                await relayed[1].drain()
                local = await asyncio.open_connection(self.local_host, self.local_port)
        except (OSError, TimeoutError) as e:
            logger.info(
                "relay link: could not forward a caller of relay %s: %s", self.relay_peer_id, e
            )
            for side in (relayed, local):
                if side is not None:
                    await close_writer(side[1])
            return
        self.connections += 1
        await splice(relayed, local)
