"""Encrypted channels to peers, pinned through their signed records (no certificate authority).

Each peer serves gRPC over TLS with a self-signed certificate made at start from its identity key
(:func:`make_certificate`), and announces the certificate in its signed DHT record (``StageRecord.tls_cert``).
Only the key's holder can write that record, so a caller that trusts exactly the certificate the record names
(:func:`open_channel`: the certificate is the channel's only root) talks to that peer or to nobody: a
man in the middle, or a record from someone else claiming the same endpoint, fails the TLS handshake.

Every certificate carries the same name, :data:`TLS_NAME`, and callers check that name rather than a host
name: a peer's address may be an IP, a NAT's, or change, while its key does not.

A peer started with ``--plaintext`` announces no certificate and serves without TLS (experiments on one
machine); callers dial such a peer in the clear, as its own signed record asks.
"""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from swarm.identity import Identity, certified_key, peer_id_of
from swarm.transport.channel import GRPC_OPTIONS

# The one name in every peer's certificate: callers pin the certificate, not a host name.
TLS_NAME = "swarm-peer"
# A certificate is made fresh at each start; it outlives any run, and begins a day early for skewed clocks.
_CERT_VALID_DAYS = 3650


@dataclass(frozen=True)
class PeerAddress:
    """How to reach one peer: where it listens, who it is (the id a caller's token names) and the certificate to
    pin (PEM; "" = the peer serves in the clear). Hashable: clients are pooled by address."""

    endpoint: str  # host:port of its gRPC server
    peer_id: str = ""  # its id ("" = unknown: its calls cannot be authenticated)
    tls_cert: str = ""  # PEM certificate from its signed record ("" = plaintext)

    @classmethod
    def of(cls, record) -> PeerAddress:
        """The address a peer's record (anything with ``endpoint``, ``peer_id``, ``tls_cert``) announces."""
        return cls(record.endpoint, record.peer_id, record.tls_cert)

    def __str__(self) -> str:
        return self.endpoint


def make_certificate(identity: Identity) -> str:
    """A self-signed certificate (PEM) for ``identity``'s key, named :data:`TLS_NAME`."""
    key = identity.rsa_key
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.peer_id),
        ]
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=_CERT_VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def server_credentials(identity: Identity, cert_pem: str) -> grpc.ServerCredentials:
    """TLS credentials for a peer's server: ``identity``'s key and its certificate (callers need none)."""
    key_pem = identity.rsa_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return grpc.ssl_server_credentials([(key_pem, cert_pem.encode())])


def open_channel(address: PeerAddress, options=GRPC_OPTIONS) -> grpc.aio.Channel:
    """A channel to ``address``: TLS trusting only its pinned certificate, or in the clear for a peer that
    announces none."""
    if not address.tls_cert:
        return grpc.aio.insecure_channel(address.endpoint, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=address.tls_cert.encode())
    return grpc.aio.secure_channel(
        address.endpoint,
        credentials,
        options=[*options, ("grpc.ssl_target_name_override", TLS_NAME)],
    )


def address_by_handshake(endpoint: str, *, timeout_s: float = 10.0) -> PeerAddress:
    """The address of whoever serves TLS at ``endpoint``: the certificate from a handshake, the id from its key.
    This trusts on first use, so it is only for tools and tests that started the peer themselves (on loopback);
    swarm pins the certificate a peer's signed record names. Blocking; OSError if nothing answers with TLS,
    ValueError if the certificate holds no RSA key."""
    host, _, port = endpoint.rpartition(":")
    cert = ssl.get_server_certificate((host.strip("[]"), int(port)), timeout=timeout_s)
    key = certified_key(cert)
    if key is None:
        raise ValueError(f"the server at {endpoint} presents a certificate without an RSA key")
    return PeerAddress(endpoint, peer_id_of(key), cert)
