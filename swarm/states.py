"""The states a peer announces for the stage it serves (DHT records, gRPC replies, the simulator).

The ``str`` mixin keeps each member equal to its wire string ("serving" == PeerState.SERVING), so records
and the proto's ``state`` field carry the same values whichever side builds them.
"""

from __future__ import annotations

import enum


class PeerState(str, enum.Enum):
    STARTING = "starting"  # loading a stage's state; counted as capacity, not routed to yet
    SERVING = "serving"  # takes new work
    DRAINING = (
        "draining"  # leaving the stage: finishes backward for its microbatches, takes no new work
    )

    # The value, not "PeerState.SERVING", wherever a state is printed, logged or formatted.
    __str__ = str.__str__
    __format__ = str.__format__


class Reachability(str, enum.Enum):
    """How callers reach a peer, as its signed record announces it (records without it read as DIRECT)."""

    DIRECT = "direct"  # its endpoint accepts connections: dial it over gRPC
    RELAYED = "relayed"  # nobody could dial its endpoint (behind NAT or a firewall): only a relay reaches it

    __str__ = str.__str__
    __format__ = str.__format__
