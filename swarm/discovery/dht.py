"""A hivemind DHT node and the run's directory on top of it: run config, per-stage peer heartbeats.

Every node is a full DHT participant unless it asks for client mode, so any peer's printed address can
bootstrap the next one; there is no central server.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from pathlib import Path

import hivemind
from hivemind.utils import ValueWithExpiration, get_dht_time

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
from swarm.identity import Identity, certified_key, fingerprint_of, owner_key, peer_id_of, verify

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
    identity: Identity | None = None,
) -> hivemind.DHT:
    """Start a DHT node (in its own process, as hivemind does) listening on ``host`` and wait until it
    has joined. ``announce_host`` is the address others should dial, when it differs from ``host``. ``identity``
    signs this node's records (default: the one at ``config.identity_path``, or a fresh one)."""
    if announce_host and config.dht_port == 0:
        raise ValueError(
            "--announce-host needs an explicit --dht-port (libp2p cannot announce port 0)"
        )
    initial_peers = resolve_initial_peers(config.initial_peers, wait_s=config.initial_peers_wait_s)
    announce = [_maddr(announce_host, config.dht_port)] if announce_host else None
    if identity is None:
        identity = Identity.load_or_create(config.identity_path)
    dht = hivemind.DHT(
        initial_peers=initial_peers,
        start=True,
        client_mode=client_mode,
        host_maddrs=[_maddr(host, config.dht_port)],
        announce_maddrs=announce,
        identity_path=None if config.identity_path is None else f"{config.identity_path}.p2p",
        # Owner-marked records (every swarm record) are stored and read back only when their owner signed them.
        record_validators=[identity.validator()],
        nat_port_map=config.nat_traversal,
        auto_nat=config.nat_traversal,
    )
    dht.swarm_identity = (
        identity  # what RunDirectory signs with: the key this node's validator signs with
    )
    return dht


def visible_addresses(dht: hivemind.DHT) -> list[str]:
    return [str(addr) for addr in dht.get_visible_maddrs()]


async def list_runs(dht: hivemind.DHT) -> dict[str, dict]:
    """The runs published in this DHT and still refreshed: run id -> {"num_stages", "config", "owners"} (the
    fingerprints of the keys that signed a config of that id: more than one means someone else uses the id)."""
    runs: dict[str, dict] = {}
    for subkey, value in (await subkey_values(dht, RUNS_KEY)).items():
        key = owner_key(subkey)
        run_id = subkey.partition(b"]/")[2].decode(errors="replace") if key else None
        if (
            run_id
            and isinstance(value, dict)
            and isinstance(value.get("num_stages"), int)
            and isinstance(value.get("config"), str)
            and isinstance(value.get("owner"), str)
        ):
            entry = runs.setdefault(
                run_id, {"num_stages": value["num_stages"], "config": value["config"], "owners": []}
            )
            if value["owner"] not in entry["owners"]:
                entry["owners"].append(value["owner"])
        else:
            logger.warning("ignoring a malformed or unsigned entry of the runs list: %r", subkey)
    return runs


async def subkey_values(dht: hivemind.DHT, key: str) -> dict:
    """The values stored under ``key``, by subkey (empty when there is none, or it is not a subkey dict)."""
    found = await dht.get(key, latest=True, return_future=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    # (a plain dict stored as one value, not by subkey, holds no ValueWithExpiration: it is nobody's record)
    return {
        subkey: item.value
        for subkey, item in found.value.items()
        if isinstance(item, ValueWithExpiration)
    }


def _valid_records(values: dict, parse, owner_of, belongs, *, what: str) -> dict:
    """``parse(value)`` of each subkey's value, by its writer's peer id, keeping those under an owner-marked subkey
    whose record names that writer (``owner_of(record)``) and ``belongs(record)``. hivemind's validator already
    checked that the subkey's key signed the value; a record under another's subkey, or under none, is refused.
    Each refusal is logged, never raised: it is remote input."""
    records = {}
    for subkey, value in values.items():
        key = owner_key(subkey)
        if key is None:
            logger.warning("ignoring an unsigned %s under subkey %.60r", what, subkey)
            continue
        writer = peer_id_of(key)
        try:
            record = parse(value)
        except RecordError as e:
            logger.warning("ignoring a malformed %s from %s: %s", what, writer, e)
            continue
        if owner_of(record) != writer or not belongs(record):
            logger.warning(
                "ignoring a %s that %s signed for another owner or place: %r", what, writer, record
            )
            continue
        cert = getattr(record, "tls_cert", "")
        if cert and certified_key(cert) != key:
            # callers pin this certificate: it must be the writer's own key, or the record could send them to
            # a server someone else holds the key of
            logger.warning(
                "ignoring a %s from %s whose TLS certificate is not its key's", what, writer
            )
            continue
        records[writer] = record
    return records


def run_signing_payload(run_id: str, config: dict) -> bytes:
    """What a run owner signs: the run id and its config, canonically encoded."""
    return (
        b"swarm run config\n"
        + run_id.encode()
        + b"\n"
        + json.dumps(config, sort_keys=True).encode()
    )


def sign_run(identity: Identity, run_id: str, config: RunConfig) -> dict:
    """The run config record as its owner publishes it, and as every peer of the run keeps it alive."""
    body = config.to_dict()
    return {
        "config": body,
        "owner": identity.public_key,
        "signature": identity.sign(run_signing_payload(run_id, body)),
    }


class RunDirectory:
    """Async view of one run in the DHT. Reads validate every record; writes carry a fresh expiration and go under
    this node's owner-marked subkey (signed by ``identity``; a directory without one only reads).

    The run config is the owner's: the first node to publish it signs it (and prints its fingerprint); every peer of
    the run then keeps that signed record alive under its own subkey, and every reader checks the owner's
    signature and, given ``run_owner`` (a fingerprint), that the owner is the pinned one."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        *,
        identity: Identity | None = None,
        run_owner: str | None = None,
    ):
        self.dht = dht
        self.run_id = run_id
        # the key this node's DHT validator signs with (start_dht keeps it with the node): no other can sign here
        self.identity = identity or getattr(dht, "swarm_identity", None)
        self.run_owner = run_owner
        self.owner: str | None = (
            None  # fingerprint of the run's owner, once its config was read or published
        )
        self._signed_run: dict | None = None  # the owner-signed config record this node keeps alive
        self._signed_fingerprint = (
            ""  # RunConfig.fingerprint() of that record's config (checked every refresh)
        )
        self._refused: set[str] = set()  # owners whose configs were refused (logged once each)

    def _writer(self) -> Identity:
        if self.identity is None:
            raise RuntimeError("this RunDirectory was opened without an identity: it can only read")
        return self.identity

    def _signed_configs(self, values: dict) -> dict[str, dict]:
        """The well-signed run config records among a config key's values, by owner fingerprint."""
        by_owner: dict[str, dict] = {}
        for subkey, value in values.items():
            if owner_key(subkey) is None:
                logger.warning("ignoring an unsigned config record of run '%s'", self.run_id)
                continue
            if not (
                isinstance(value, dict)
                and isinstance(value.get("config"), dict)
                and isinstance(value.get("owner"), bytes)
                and isinstance(value.get("signature"), bytes)
            ):
                logger.warning("ignoring a malformed config record of run '%s'", self.run_id)
                continue
            payload = run_signing_payload(self.run_id, value["config"])
            if not verify(value["owner"], payload, value["signature"]):
                logger.warning(
                    "ignoring a config record of run '%s' whose owner signature does not verify (a forgery, "
                    "or a config changed after signing)",
                    self.run_id,
                )
                continue
            by_owner.setdefault(fingerprint_of(value["owner"]), value)
        return by_owner

    async def get_run(self) -> RunConfig | None:
        by_owner = self._signed_configs(await subkey_values(self.dht, config_key(self.run_id)))
        if self.run_owner is not None:
            for owner in by_owner.keys() - {self.run_owner} - self._refused:
                self._refused.add(owner)
                logger.warning(
                    "refusing a config of run '%s' signed by key %s: the run is pinned to owner %s (--run-owner)",
                    self.run_id,
                    owner,
                    self.run_owner,
                )
            owner = self.run_owner if self.run_owner in by_owner else None
        else:
            # Peers started together may each create the run, signing the same config: one run. Different configs
            # under one id are not (someone else uses the id, or attacks an unpinned run).
            configs = {json.dumps(v["config"], sort_keys=True) for v in by_owner.values()}
            if len(configs) > 1:
                raise RecordError(
                    f"run '{self.run_id}' has {len(configs)} different configs, signed by keys "
                    f"{', '.join(sorted(by_owner))}: someone else uses this run id; pass --run-owner with the "
                    f"fingerprint its creator printed"
                )
            owner = min(by_owner, default=None)  # the same on every node
        if owner is None:
            return None
        if self.owner != owner:
            logger.info(
                "run '%s' is owned by key %s (pin it with --run-owner %s)",
                self.run_id,
                owner,
                owner,
            )
        signed = by_owner[owner]
        try:
            config = RunConfig.from_dict(signed["config"])
        except UnknownCodecError as e:  # a well-formed record this build cannot serve
            raise UnknownCodecError(f"run '{self.run_id}': {e}") from None
        except (ValueError, TypeError) as e:
            raise RecordError(
                f"run '{self.run_id}' has a malformed config record in the DHT: {e}"
            ) from None
        self.owner, self._signed_run, self._signed_fingerprint = owner, signed, config.fingerprint()
        return config

    async def publish_run(self, config: RunConfig, *, ttl_s: float) -> bool:
        """Store (or refresh) the run config under this node's subkey, and list the run under :data:`RUNS_KEY`.
        A node that has not read the run's config signs it as the run's owner (a new run); every other node
        refreshes the owner's signed record as read. Several peers refresh the same record: a DHT node keeps each
        subkey's latest copy, so the record lives as long as any peer of the run does."""
        identity = self._writer()
        if self._signed_run is None:
            self._signed_run, self.owner = (
                sign_run(identity, self.run_id, config),
                identity.fingerprint,
            )
            self._signed_fingerprint = config.fingerprint()
            logger.info(
                "run '%s' created by this node: its owner key's fingerprint is %s (pin it on other nodes with "
                "--run-owner %s)",
                self.run_id,
                self.owner,
                self.owner,
            )
        elif self._signed_fingerprint != config.fingerprint():
            raise ValueError(
                f"run '{self.run_id}' already has another config, signed by {self.owner}; a run's config cannot "
                f"change (start a new run id)"
            )
        expiration = get_dht_time() + ttl_s
        stored, _ = await asyncio.gather(
            self.dht.store(
                config_key(self.run_id),
                self._signed_run,
                expiration,
                subkey=identity.owner_marker,
                return_future=True,
            ),
            self.dht.store(
                RUNS_KEY,
                {
                    "num_stages": config.model.num_stages,
                    "config": config.fingerprint(),
                    "owner": self.owner,
                },
                expiration,
                subkey=identity.owner_marker + b"/" + self.run_id.encode(),
                return_future=True,
            ),
        )
        return stored

    async def wait_for_run(self, *, timeout_s: float, poll_s: float = 0.5) -> RunConfig:
        deadline = time.monotonic() + timeout_s
        while (config := await self.get_run()) is None:
            if time.monotonic() > deadline and self._refused:
                raise TimeoutError(
                    f"run '{self.run_id}' has configs only from keys {', '.join(sorted(self._refused))}, not from "
                    f"its pinned owner {self.run_owner}: check --run-owner against the fingerprint the run's "
                    f"creator printed"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no run '{self.run_id}' was published in the DHT within {timeout_s:.0f}s: "
                    f"start the run with its first peer, `swarm peer --run-id {self.run_id} "
                    f"--stage 0 --preset tiny` (or another preset), or check --initial-peers"
                )
            await asyncio.sleep(poll_s)  # the DHT has no watch/notify; poll with a bound
        return config

    async def announce(self, record: StageRecord, *, ttl_s: float) -> bool:
        identity = self._writer()
        if record.peer_id != identity.peer_id:
            raise ValueError(
                f"a record for peer {record.peer_id} cannot be signed by {identity.peer_id}"
            )
        # A subkey record is replaced only by a strictly later expiration, so each heartbeat uses a fresh one.
        return await self.dht.store(
            stage_key(self.run_id, record.stage),
            record.to_wire(),
            get_dht_time() + ttl_s,
            subkey=identity.owner_marker,
            return_future=True,
        )

    async def claim(self, key: str, *, ttl_s: float) -> None:
        """Add this node to the claimers under ``key`` (a subkey each, so concurrent claims all land)."""
        await self.dht.store(
            f"swarm/{self.run_id}/{key}",
            True,
            get_dht_time() + ttl_s,
            subkey=self._writer().owner_marker,
            return_future=True,
        )

    async def claimers(self, key: str) -> frozenset[str]:
        """The peer ids that claimed ``key`` (signed claims only)."""
        values = await subkey_values(self.dht, f"swarm/{self.run_id}/{key}")
        return frozenset(peer_id_of(k) for k in map(owner_key, values) if k is not None)

    async def stage_records(self, stage: int) -> dict[str, StageRecord]:
        """Live peers announced for ``stage``, by peer id. Malformed or misplaced records are dropped and logged."""
        return _valid_records(
            await subkey_values(self.dht, stage_key(self.run_id, stage)),
            StageRecord.from_wire,
            lambda record: record.peer_id,
            lambda record: record.stage == stage,
            what=f"record for stage {stage}",
        )

    async def announce_trainer(self, record: TrainerRecord, *, ttl_s: float) -> bool:
        identity = self._writer()
        if record.trainer_id != identity.peer_id:
            raise ValueError(
                f"a record for trainer {record.trainer_id} cannot be signed by {identity.peer_id}"
            )
        return await self.dht.store(
            trainers_key(self.run_id),
            record.to_wire(),
            get_dht_time() + ttl_s,
            subkey=identity.owner_marker,
            return_future=True,
        )

    async def trainer_records(self) -> dict[str, TrainerRecord]:
        """Live trainers of the run, by trainer id. Malformed or misplaced records are dropped and logged."""
        return _valid_records(
            await subkey_values(self.dht, trainers_key(self.run_id)),
            TrainerRecord.from_wire,
            lambda record: record.trainer_id,
            lambda record: True,
            what="trainer record",
        )

    async def all_stages(self, num_stages: int) -> list[dict[str, StageRecord]]:
        return list(await asyncio.gather(*(self.stage_records(s) for s in range(num_stages))))
