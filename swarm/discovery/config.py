"""How a node joins the DHT: the config behind every command's DHT flags (imports no hivemind)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_FINGERPRINT = re.compile(r"[0-9a-f]{32}")
# How a caller list names a key: its peer id or its fingerprint (the peer id is the fingerprint's first 16 digits).
KEY_NAME = re.compile(r"[0-9a-f]{16}(?:[0-9a-f]{16})?")


@dataclass(frozen=True, kw_only=True)
class DHTConfig:
    FLAG_TITLE = "DHT (finding the swarm)"

    # multiaddrs of any running node; "@FILE" reads them from FILE
    initial_peers: tuple[str, ...] = ()
    # TCP port of this node's DHT (0 = any free port; set it with --announce-host)
    dht_port: int = 0
    # this node's key file (created if missing): its peer id, and the key that signs its DHT records, across
    # restarts (its libp2p key is kept next to it, at PATH.p2p); without it, a new identity each start
    identity_path: str | None = None
    # fingerprint of the run owner's key (printed when the run is created): a run config signed by any other key is
    # refused (without it, the one config published under the run id is accepted, and its owner logged)
    run_owner: str | None = None
    nat_traversal: bool = False  # UPnP/NAT-PMP and AutoNAT probing (sends traffic to your gateway)
    initial_peers_wait_s: float = 60.0  # how long to wait for an "@FILE" of initial peers to appear

    def __post_init__(self):
        if self.run_owner is not None and not _FINGERPRINT.fullmatch(self.run_owner):
            raise ValueError(
                f"run_owner must be the 32 lowercase hex digits of the owner key's fingerprint (as printed when the "
                f"run was created), got {self.run_owner!r}"
            )
        if not 0 <= self.dht_port <= 65535:
            raise ValueError(f"dht_port must be in [0, 65535], got {self.dht_port}")
