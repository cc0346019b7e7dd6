"""Records peers publish in the DHT, validated on read.

Everything read from the DHT is remote input: a record is parsed field by field by
:func:`swarm.schema.parse_dataclass` (unknown fields are left out with a warning: a newer peer may add some),
and a record that is malformed is dropped with a log line instead of crashing the reader.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from swarm.errors import SwarmError
from swarm.identity import is_peer_id
from swarm.model.digest import is_digest
from swarm.schema import parse_dataclass
from swarm.states import PeerState, Reachability

logger = logging.getLogger(__name__)

RECORD_VERSION = 1


class RecordError(SwarmError, ValueError):
    """A DHT record failed validation: remote input, so the reader drops it (or, for the run config, stops
    with this sentence)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    retry_elsewhere = False


def config_key(run_id: str) -> str:
    return f"swarm/{run_id}/config"


def stage_key(run_id: str, stage: int) -> str:
    return f"swarm/{run_id}/stage/{stage}"


def _parse(cls, value: Any, what: str):
    """``cls`` from the wire ``value`` by the one parser of remote records; RecordError if it does not fit."""
    try:
        return parse_dataclass(cls, value, what=what, finite=True)
    except ValueError as e:
        raise RecordError(str(e)) from None


def trainers_key(run_id: str) -> str:
    return f"swarm/{run_id}/trainers"


# Every published run also lists itself here (a subkey per run id), so `swarm status --list-runs` finds them.
RUNS_KEY = "swarm/runs"


@dataclass(frozen=True, kw_only=True)
class StageRecord:
    """One peer's heartbeat for the stage it serves."""

    peer_id: str  # stable identity of the peer (also the DHT subkey)
    endpoint: str  # host:port of its gRPC server
    stage: int  # stage index it serves
    state: PeerState
    throughput: float  # measured samples/s for forward + backward of this stage
    in_flight: int  # requests being handled right now
    step: int  # optimizer steps its replica has taken
    config_hash: str  # RunConfig.fingerprint() of the config it runs
    # DHT time of its arrival or last change of stage (0 = unknown), for rebalancing cooldown
    last_moved_s: float = 0.0
    # how long its optimizer steps (the all-reduce) hold its compute: calls wait that much more
    step_pause_s: float = 0.0
    # swarm.model.state_digest of its parameters at `step` ("" = not known: an older peer, or not hashed yet)
    param_digest: str = ""
    # DHT time of this heartbeat (0 = not known: an older peer); status shows its age
    announced_s: float = 0.0
    device: str = ""  # where the stage computes, e.g. "cpu" ("" = not known: an older peer)
    dtype: str = ""  # its compute dtype: fp32, bf16 or fp16 ("" = not known: an older peer)
    # bytes its stage is estimated to take on the device, and all the device's memory (0 = not known)
    memory_bytes: int = 0
    device_memory_bytes: int = 0
    # it all-reduces gradients with its stage's other replicas and steps with them once per global batch
    # (False for --no-average, and for an older peer)
    averaging: bool = False
    # PEM certificate of its gRPC server's TLS key, which callers pin ("" = it serves in the clear: --plaintext)
    tls_cert: str = ""
    # whether callers can dial its endpoint, as a peer of the run found when it dialed back at its start
    # (swarm.peer.reachability); an older peer's record, without it, reads as direct
    reachability: Reachability = Reachability.DIRECT
    # a relayed peer: the relay whose endpoint it announces (swarm.transport.relay; "" = none: nobody can call it)
    relay_peer_id: str = ""
    # a directly reachable peer relaying for others: the TCP port of its relay service, on its endpoint's host
    # (0 = it relays for nobody)
    relay_port: int = 0
    version: int = RECORD_VERSION

    def to_wire(self) -> dict[str, Any]:
        # The DHT's msgpack takes exact types only: enums go as their plain strings.
        return {
            **dataclasses.asdict(self),
            "state": PeerState(self.state).value,
            "reachability": Reachability(self.reachability).value,
        }

    @classmethod
    def from_wire(cls, value: Any) -> StageRecord:
        # fields with defaults were added in later versions; unknown ones come from newer peers
        record = _parse(cls, value, "stage record")
        if (
            record.stage < 0
            or record.throughput < 0
            or record.in_flight < 0
            or record.step_pause_s < 0
            or record.memory_bytes < 0
            or record.device_memory_bytes < 0
            or not 0 <= record.relay_port <= 65535
        ):
            raise RecordError(f"stage record has out-of-range values: {value!r}")
        if ":" not in record.endpoint and record.state != PeerState.STARTING:
            raise RecordError(
                f"stage record of a {record.state} peer needs a host:port endpoint, got "
                f"{record.endpoint!r}"
            )
        if record.param_digest and not is_digest(record.param_digest):
            raise RecordError(
                f"stage record's param_digest must be 16 lowercase hex characters or empty, got "
                f"{record.param_digest[:40]!r}"
            )
        if record.relay_peer_id and not is_peer_id(record.relay_peer_id):
            raise RecordError(
                f"stage record's relay_peer_id must be a peer id (16 lowercase hex characters) or empty, got "
                f"{record.relay_peer_id[:40]!r}"
            )
        return record

    @property
    def callable(self) -> bool:
        """Whether a caller can open a connection to it: directly, or through the relay it announces."""
        return self.reachability == Reachability.DIRECT or bool(self.relay_peer_id)


@dataclass(frozen=True, kw_only=True)
class TrainerRecord:
    """One trainer's heartbeat: how far it got and how its training goes (for status and the dashboard)."""

    trainer_id: str  # also the DHT subkey
    step: int  # global batches trained
    loss: float | None = None  # mean training loss of its last global batch (None before the first)
    val_loss: float | None = None  # its last validation loss (None before the first)
    tokens_per_s: float = 0.0  # since it started training
    microbatches: int = 0  # completed
    announced_s: float = 0.0  # DHT time of this heartbeat (0 = not known: an older trainer)
    version: int = RECORD_VERSION

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, value: Any) -> TrainerRecord:
        record = _parse(cls, value, "trainer record")
        if record.step < 0 or record.tokens_per_s < 0 or record.microbatches < 0:
            raise RecordError(f"trainer record has out-of-range values: {value!r}")
        return record
