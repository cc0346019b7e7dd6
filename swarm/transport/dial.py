"""One connection attempt to a peer's endpoint, as a caller would make it: is anyone there with the pinned key?

Used by a peer answering DialBack (``swarm.peer.reachability``). A TLS channel becomes ready only after a handshake
with the certificate the record pins, so success means the key's holder listens at that endpoint; a plaintext
channel, after an HTTP/2 connection. Nothing is sent in a call: the dialed peer need not admit the dialer.

``refuses`` asks less: whether any process still holds the endpoint's port (a trainer deciding whether a replica
whose call failed is gone, ``swarm.trainer.stagesteps``).
"""

from __future__ import annotations

import asyncio
import ipaddress

from swarm.deadline import timeout
from swarm.transport.security import PeerAddress, open_channel


async def dial(address: PeerAddress, *, timeout_s: float) -> str:
    """ "" if a channel to ``address`` became ready within ``timeout_s``, else why not (a sentence)."""
    channel = open_channel(address)
    try:
        async with timeout(timeout_s):
            await channel.channel_ready()
        return ""
    except TimeoutError:
        state = channel.get_state(try_to_connect=False)
        what = (
            "a TLS handshake with the key its record pins" if address.tls_cert else "a connection"
        )
        return (
            f"no {what} to {address.endpoint} within {timeout_s:g}s (channel {state.name.lower()}): "
            f"nothing accepts connections there from outside, or another key answers"
        )
    finally:
        await channel.close(grace=None)


async def refuses(endpoint: str, *, timeout_s: float) -> bool:
    """Whether nothing listens at ``endpoint`` any more: a TCP connection to it is refused or reset, or none opens
    within ``timeout_s`` (no host there). False when one opens: a process holds the port, alive though it may not
    answer (frozen, or too busy: the kernel accepts connections for it). A gRPC call fails UNAVAILABLE in both cases
    (a frozen peer's channel ends on its keepalive), and only the first means the peer is gone."""
    try:
        host, port = split_endpoint(endpoint)
        async with timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError, ValueError):
        return True
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return False


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of "host:port" or "[v6]:port"; ValueError with the reason if it is not one."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint must be host:port with a port in [1, 65535], got {endpoint!r}")
    return host, int(port)


def peer_host(peer: str) -> str:
    """The caller's IP address from gRPC's ``context.peer()`` ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678"); "" if
    it names none (a unix socket). An IPv4-mapped IPv6 address is given as IPv4."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in rest:
        return ""
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return ""
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)
