"""What a peer's relay service may spend and how relayed peers keep their channel (swarm.transport.relay). Kept
apart from the relay itself so that the CLI builds its flags without importing grpc, hivemind or torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """Relaying for others (a directly reachable peer) and through others (a peer behind NAT)."""

    FLAG_TITLE = "relay (peers behind NAT)"

    # lend a public port to peers of the run behind NAT (only when this peer is directly reachable); a relay
    # copies their callers' bytes (encrypted end to end), so it spends its bandwidth on them
    relay_for_others: bool = True
    # TCP port of the relay service on --host (0 = any free port; announced in the record)
    relay_port: int = 0
    relay_max_peers: int = 16  # peers behind NAT this peer relays for at once
    # relayed connections at once (callers of all its relayed peers), and connections still sending their first line
    relay_max_connections: int = 64
    # bytes per second the relay copies, both ways together (0 = no bound)
    relay_max_bytes_per_s: float = 0.0
    # seconds between keepalives on a control channel; 3 missed and the channel is dead (the relayed peer then
    # picks another relay)
    relay_keepalive_s: float = 5.0
    # seconds a relayed peer has to open its data connection for a caller, and a new connection to send its
    # first line
    relay_open_timeout_s: float = 5.0

    def __post_init__(self):
        if not 0 <= self.relay_port <= 65535:
            raise ValueError(f"relay_port must be in [0, 65535], got {self.relay_port}")
        if self.relay_max_peers < 1 or self.relay_max_connections < 1:
            raise ValueError(
                f"relay_max_peers ({self.relay_max_peers}) and relay_max_connections "
                f"({self.relay_max_connections}) must be >= 1; use --no-relay-for-others to relay for nobody"
            )
        if self.relay_max_bytes_per_s < 0:
            raise ValueError(
                f"relay_max_bytes_per_s must be >= 0 (0 = no bound), got {self.relay_max_bytes_per_s}"
            )
        if not 0 < self.relay_keepalive_s <= 60 or not 0 < self.relay_open_timeout_s <= 60:
            raise ValueError(
                f"relay_keepalive_s and relay_open_timeout_s must be in (0, 60], got "
                f"{self.relay_keepalive_s} and {self.relay_open_timeout_s}"
            )
