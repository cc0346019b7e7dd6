"""Who a peer or trainer is: an RSA key pair, kept in ``--identity-path`` (PEM) or made fresh per start.

Everything that names a node derives from its public key, so a name cannot be claimed without the key:

* its **peer id** (16 hex digits, in logs, status and routing) and its **fingerprint** (32 hex digits, what a run is
  pinned by: ``--run-owner``) are digests of the public key;
* its DHT records sit under an owner-marked subkey (hivemind's ``[owner:<public key>]``): every DHT node of the
  swarm runs hivemind's signature validator, so a record under that subkey is stored and read back only if the key's
  holder signed it (see :mod:`swarm.discovery.dht`);
* the run config carries its owner's signature over the run id and the config, so any peer can keep it alive in the
  DHT but none can change it.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

PEER_ID_HEX = 16
FINGERPRINT_HEX = 32
_PEER_ID = re.compile(rf"[0-9a-f]{{{PEER_ID_HEX}}}")
_MARKER = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)


class IdentityError(ValueError):
    """An identity file that cannot be used, or a key that is not one."""


def key_digest(public_key: bytes, length: int) -> str:
    """The first ``length`` hex digits of SHA-256 over a public key in OpenSSH form."""
    return hashlib.sha256(public_key).hexdigest()[:length]


def peer_id_of(public_key: bytes) -> str:
    return key_digest(public_key, PEER_ID_HEX)


def is_peer_id(text: str) -> bool:
    """Whether ``text`` has the form :func:`peer_id_of` returns (PEER_ID_HEX lowercase hex digits)."""
    return _PEER_ID.fullmatch(text) is not None


def fingerprint_of(public_key: bytes) -> str:
    return key_digest(public_key, FINGERPRINT_HEX)


def owner_key(subkey) -> bytes | None:
    """The public key in an owner-marked DHT subkey (bytes holding exactly one ``[owner:...]``), else None."""
    if not isinstance(subkey, bytes):
        return None
    keys = _MARKER.findall(subkey)
    return keys[0] if len(keys) == 1 else None


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` (from :meth:`Identity.sign`) is the holder of ``public_key``'s over ``data``."""
    try:
        key = RSAPublicKey.from_bytes(public_key)
    except (ValueError, TypeError):
        return False
    return key.verify(data, signature)


def certified_key(cert_pem: str) -> bytes | None:
    """The public key (OpenSSH form) a PEM certificate certifies; None if the text is not a certificate with an
    RSA key."""
    try:
        key = x509.load_pem_x509_certificate(cert_pem.encode()).public_key()
    except (ValueError, TypeError):
        return None
    if not isinstance(key, rsa.RSAPublicKey):
        return None
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


def _wrap(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    """hivemind's key class around a loaded key (its constructor always generates a new one)."""
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped._private_key = key
    return wrapped


class Identity:
    def __init__(self, private_key: RSAPrivateKey):
        self.private_key = private_key
        self.public_key: bytes = private_key.get_public_key().to_bytes()  # OpenSSH form
        self.peer_id = peer_id_of(self.public_key)
        self.fingerprint = fingerprint_of(self.public_key)
        # the DHT subkey only this identity can write (hivemind's signature validator enforces it)
        self.owner_marker: bytes = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(
            b"_key_", self.public_key
        )

    @classmethod
    def ephemeral(cls) -> Identity:
        return cls(RSAPrivateKey())

    @classmethod
    def load_or_create(cls, path: str | os.PathLike | None) -> Identity:
        """The identity kept at ``path`` (created there, readable by its owner only, if missing); a fresh one for
        this start when ``path`` is None."""
        if path is None:
            return cls.ephemeral()
        path = Path(path)
        if path.exists():
            try:
                key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except (ValueError, TypeError) as e:
                raise IdentityError(
                    f"identity file {path} is not an unencrypted PEM private key ({e}); point --identity-path at "
                    f"another file and a new identity is created there"
                ) from None
            if not isinstance(key, rsa.RSAPrivateKey):
                raise IdentityError(
                    f"identity file {path} holds a {type(key).__name__}, not an RSA key"
                )
            return cls(_wrap(key))
        identity = cls.ephemeral()
        pem = identity.rsa_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # created 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # never replaces an identity another process created meanwhile
        except FileExistsError:
            return cls.load_or_create(path)
        finally:
            os.unlink(tmp)
        return identity

    @property
    def rsa_key(self) -> rsa.RSAPrivateKey:
        """The key itself (``cryptography``'s), e.g. for a TLS certificate: hivemind's wrapper keeps it in a
        private field, read here only."""
        return self.private_key._private_key

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def validator(self) -> RSASignatureValidator:
        """hivemind's record validator signing with this identity: every DHT node of the swarm runs one."""
        return RSASignatureValidator(self.private_key)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id}, fingerprint={self.fingerprint})"
