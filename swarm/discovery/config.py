"""How a node joins the DHT: the config behind every command's DHT flags (imports no hivemind)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DHTConfig:
    FLAG_TITLE = "DHT (finding the swarm)"

    # multiaddrs of any running node; "@FILE" reads them from FILE
    initial_peers: tuple[str, ...] = ()
    # TCP port of this node's DHT (0 = any free port; set it with --announce-host)
    dht_port: int = 0
    # private key file: keeps the node's DHT peer id across restarts
    identity_path: str | None = None
    nat_traversal: bool = False  # UPnP/NAT-PMP and AutoNAT probing (sends traffic to your gateway)
    initial_peers_wait_s: float = 60.0  # how long to wait for an "@FILE" of initial peers to appear

    def __post_init__(self):
        if not 0 <= self.dht_port <= 65535:
            raise ValueError(f"dht_port must be in [0, 65535], got {self.dht_port}")
