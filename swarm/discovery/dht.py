"""A hivemind DHT node and the run's directory on top of it: run config, per-stage peer heartbeats.

Every node is a full DHT participant unless it asks for client mode, so any peer's printed address can
bootstrap the next one; there is no central server.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from pathlib import Path

import hivemind
from hivemind.utils import get_dht_time

from swarm.compression import UnknownCodecError
from swarm.config import RunConfig
from swarm.discovery.config import DHTConfig
from swarm.discovery.records import (
    RUNS_KEY,
    RecordError,
    StageRecord,
    TrainerRecord,
    config_key,
    stage_key,
    trainers_key,
)
from swarm.forking import protect_forks

logger = logging.getLogger(__name__)

protect_forks()  # hivemind forks its DHT (and averagers) from processes that may run gRPC: see swarm.forking


def resolve_initial_peers(values: tuple[str, ...], *, wait_s: float) -> list[str]:
    """Expand "@FILE" entries into the multiaddrs listed in FILE (one per line), waiting up to ``wait_s``
    seconds for FILE to appear (a bootstrap node in another container may still be starting)."""
    out: list[str] = []
    for value in values:
        if not value.startswith("@"):
            out.append(value)
            continue
        path, deadline = Path(value[1:]), time.monotonic() + wait_s
        while not (path.exists() and path.read_text().strip()):
            if time.monotonic() > deadline:
                raise FileNotFoundError(
                    f"initial peers file {path} did not appear within {wait_s:.0f}s; "
                    f"start `swarm dht --address-file {path}` first"
                )
            time.sleep(0.2)  # polling a file another process writes; there is no event to wait on
        out.extend(line.strip() for line in path.read_text().splitlines() if line.strip())
    return out


def _maddr(host: str, port: int) -> str:
    try:
        kind = "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
    except ValueError:
        kind = "dns4"  # a host name, e.g. a container's service name
    return f"/{kind}/{host}/tcp/{port}"


def start_dht(
    config: DHTConfig,
    *,
    host: str = "127.0.0.1",
    announce_host: str | None = None,
    client_mode: bool = False,
) -> hivemind.DHT:
    """Start a DHT node (in its own process, as hivemind does) listening on ``host`` and wait until it
    has joined. ``announce_host`` is the address others should dial, when it differs from ``host``."""
    if announce_host and config.dht_port == 0:
        raise ValueError(
            "--announce-host needs an explicit --dht-port (libp2p cannot announce port 0)"
        )
    initial_peers = resolve_initial_peers(config.initial_peers, wait_s=config.initial_peers_wait_s)
    announce = [_maddr(announce_host, config.dht_port)] if announce_host else None
    return hivemind.DHT(
        initial_peers=initial_peers,
        start=True,
        client_mode=client_mode,
        host_maddrs=[_maddr(host, config.dht_port)],
        announce_maddrs=announce,
        identity_path=config.identity_path,
        nat_port_map=config.nat_traversal,
        auto_nat=config.nat_traversal,
    )


def visible_addresses(dht: hivemind.DHT) -> list[str]:
    return [str(addr) for addr in dht.get_visible_maddrs()]


async def list_runs(dht: hivemind.DHT) -> dict[str, dict]:
    """The runs published in this DHT and still refreshed: run id -> {"num_stages", "config"}."""
    runs = {}
    for run_id, value in (await _subkey_values(dht, RUNS_KEY)).items():
        if (
            isinstance(run_id, str)
            and isinstance(value, dict)
            and isinstance(value.get("num_stages"), int)
            and isinstance(value.get("config"), str)
        ):
            runs[run_id] = {"num_stages": value["num_stages"], "config": value["config"]}
        else:
            logger.warning("ignoring a malformed entry of the runs list: %r", run_id)
    return runs


async def _subkey_values(dht: hivemind.DHT, key: str) -> dict:
    """The values stored under ``key``, by subkey (empty when there is none, or it is not a subkey dict)."""
    found = await dht.get(key, latest=True, return_future=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {subkey: item.value for subkey, item in found.value.items()}


def _valid_records(values: dict, parse, belongs, *, what: str) -> dict:
    """``parse(value)`` of each subkey's value, keeping those that parse and ``belongs(subkey, record)``
    (a record under another's subkey is refused); each refusal is logged, never raised: it is remote input."""
    records = {}
    for subkey, value in values.items():
        try:
            record = parse(value)
        except RecordError as e:
            logger.warning("ignoring a malformed %s from %r: %s", what, subkey, e)
            continue
        if not belongs(subkey, record):
            logger.warning(
                "ignoring a %s under subkey %r that names another owner: %r", what, subkey, record
            )
            continue
        records[subkey] = record
    return records


class RunDirectory:
    """Async view of one run in the DHT. Reads validate every record; writes carry a fresh expiration."""

    def __init__(self, dht: hivemind.DHT, run_id: str):
        self.dht = dht
        self.run_id = run_id

    async def get_run(self) -> RunConfig | None:
        found = await self.dht.get(config_key(self.run_id), latest=True, return_future=True)
        if found is None:
            return None
        try:
            return RunConfig.from_dict(found.value)
        except UnknownCodecError as e:  # a well-formed record this build cannot serve
            raise UnknownCodecError(f"run '{self.run_id}': {e}") from None
        except (ValueError, TypeError) as e:
            raise RecordError(
                f"run '{self.run_id}' has a malformed config record in the DHT: {e}"
            ) from None

    async def publish_run(self, config: RunConfig, *, ttl_s: float) -> bool:
        """Store (or refresh) the run config, and list the run under :data:`RUNS_KEY`. Several peers refresh
        the same record; a node keeps the copy with the latest expiration and answers False to the others,
        which is harmless."""
        expiration = get_dht_time() + ttl_s
        stored, _ = await asyncio.gather(
            self.dht.store(
                config_key(self.run_id), config.to_dict(), expiration, return_future=True
            ),
            self.dht.store(
                RUNS_KEY,
                {"num_stages": config.model.num_stages, "config": config.fingerprint()},
                expiration,
                subkey=self.run_id,
                return_future=True,
            ),
        )
        return stored

    async def wait_for_run(self, *, timeout_s: float, poll_s: float = 0.5) -> RunConfig:
        deadline = time.monotonic() + timeout_s
        while (config := await self.get_run()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no run '{self.run_id}' was published in the DHT within {timeout_s:.0f}s: "
                    f"start the run with its first peer, `swarm peer --run-id {self.run_id} "
                    f"--stage 0 --preset tiny` (or another preset), or check --initial-peers"
                )
            await asyncio.sleep(poll_s)  # the DHT has no watch/notify; poll with a bound
        return config

    async def announce(self, record: StageRecord, *, ttl_s: float) -> bool:
        # A subkey record is replaced only by a strictly later expiration, so each heartbeat uses a fresh one.
        return await self.dht.store(
            stage_key(self.run_id, record.stage),
            record.to_wire(),
            get_dht_time() + ttl_s,
            subkey=record.peer_id,
            return_future=True,
        )

    async def claim(self, key: str, peer_id: str, *, ttl_s: float) -> None:
        """Add ``peer_id`` to the claimers under ``key`` (a subkey each, so concurrent claims all land)."""
        await self.dht.store(
            f"swarm/{self.run_id}/{key}",
            True,
            get_dht_time() + ttl_s,
            subkey=peer_id,
            return_future=True,
        )

    async def claimers(self, key: str) -> frozenset[str]:
        found = await self.dht.get(f"swarm/{self.run_id}/{key}", latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return frozenset()
        return frozenset(k for k in found.value if isinstance(k, str))

    async def stage_records(self, stage: int) -> dict[str, StageRecord]:
        """Live peers announced for ``stage``, by peer id. Malformed records are dropped and logged."""
        return _valid_records(
            await _subkey_values(self.dht, stage_key(self.run_id, stage)),
            StageRecord.from_wire,
            lambda subkey, record: record.peer_id == subkey and record.stage == stage,
            what=f"record for stage {stage}",
        )

    async def announce_trainer(self, record: TrainerRecord, *, ttl_s: float) -> bool:
        return await self.dht.store(
            trainers_key(self.run_id),
            record.to_wire(),
            get_dht_time() + ttl_s,
            subkey=record.trainer_id,
            return_future=True,
        )

    async def trainer_records(self) -> dict[str, TrainerRecord]:
        """Live trainers of the run, by trainer id. Malformed records are dropped and logged."""
        return _valid_records(
            await _subkey_values(self.dht, trainers_key(self.run_id)),
            TrainerRecord.from_wire,
            lambda subkey, record: record.trainer_id == subkey,
            what="trainer record",
        )

    async def all_stages(self, num_stages: int) -> list[dict[str, StageRecord]]:
        return list(await asyncio.gather(*(self.stage_records(s) for s in range(num_stages))))
