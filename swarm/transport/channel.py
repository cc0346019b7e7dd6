"""gRPC options shared by servers and clients."""

from __future__ import annotations

# One chunk frame holds at most a few MiB (segments default to 1 MiB raw); leave room for headers.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Detect dead connections (a peer host that vanished) without waiting for TCP timeouts.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # ...and let those pings through as a server. By default a server allows one ping per 5 minutes while it sends
    # nothing and answers more with GOAWAY "too many pings", which fails every call on the connection at once: a
    # trainer whose only live peer of a stage was busy for ~30 s (a replica reloading its state after a groupmate
    # was killed, seen in tests/test_compose_live.py) spent all its attempts on that error in an instant.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # A new peer replacing a dead one at the same address should be reachable at once.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

# Invocation-metadata key of a call's work deadline, seconds from the call's start (a decimal string). A call
# that commits keeps its gRPC deadline open past the work's for the commit (PeerClient's commit grace); this key
# tells the peer when the caller really stops waiting for the reply, so it does not start work nobody will use.
WORK_TIMEOUT_KEY = "swarm-work-timeout-s"
