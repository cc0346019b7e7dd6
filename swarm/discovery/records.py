"""Records peers publish in the DHT, validated on read.

Everything read from the DHT is remote input: a record is parsed field by field, unknown fields are
ignored (a newer peer may add some), and a record that is malformed is dropped with a log line instead of
crashing the reader.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from swarm.states import PeerState

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
PEER_STATES = tuple(s.value for s in PeerState)


class RecordError(ValueError):
    """A DHT record failed validation."""


def config_key(run_id: str) -> str:
    return f"swarm/{run_id}/config"


def stage_key(run_id: str, stage: int) -> str:
    return f"swarm/{run_id}/stage/{stage}"


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
    last_moved_s: float = 0.0  # DHT time of its arrival or last change of stage (0 = unknown), for rebalancing cooldown
    step_pause_s: float = 0.0  # how long its optimizer steps (the all-reduce) hold its compute: calls wait that much more
    version: int = RECORD_VERSION

    def to_wire(self) -> dict[str, Any]:
        # The DHT's msgpack takes exact types only: the state goes as its plain string.
        return {**dataclasses.asdict(self), "state": PeerState(self.state).value}

    @classmethod
    def from_wire(cls, value: Any) -> StageRecord:
        if not isinstance(value, dict):
            raise RecordError(f"stage record must be a dict, got {type(value).__name__}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in value:
                if f.default is not dataclasses.MISSING:
                    continue  # optional field (added in a later version)
                raise RecordError(f"stage record lacks field '{f.name}'")
            v = value[f.name]
            expected = {"str": str, "PeerState": str, "int": int, "float": (int, float)}[f.type]
            if isinstance(v, bool) or not isinstance(v, expected):
                raise RecordError(f"stage record field '{f.name}' must be {f.type}, got {v!r}")
            kwargs[f.name] = float(v) if f.type == "float" else v
        if kwargs["state"] not in PEER_STATES:
            raise RecordError(f"stage record state '{kwargs['state']}' is not one of {PEER_STATES}")
        kwargs["state"] = PeerState(kwargs["state"])
        record = cls(**kwargs)
        if record.stage < 0 or not (math.isfinite(record.throughput) and record.throughput >= 0) \
                or record.in_flight < 0 or not math.isfinite(record.last_moved_s) \
                or not (math.isfinite(record.step_pause_s) and record.step_pause_s >= 0):
            raise RecordError(f"stage record has out-of-range values: {value!r}")
        if ":" not in record.endpoint and record.state != PeerState.STARTING:
            raise RecordError(f"stage record of a {record.state} peer needs a host:port endpoint, got "
                              f"{record.endpoint!r}")
        return record
