"""``swarm callers``: the run owner's list of the keys its peers admit (see :mod:`swarm.discovery.callerlist`)."""

from __future__ import annotations

import asyncio
import dataclasses

from swarm.discovery.callerlist import CallerList, publish_caller_list, read_caller_list
from swarm.discovery.config import DHTConfig
from swarm.discovery.dht import RunDirectory, start_dht
from swarm.errors import UsageError
from swarm.identity import Identity
from swarm.peer.members import load_allow_callers

# How long a published list lives in the DHT unless published again.
DEFAULT_TTL_S = 7 * 24 * 3600.0


def describe(run_id: str, listed: CallerList | None, owner: str | None) -> str:
    if listed is None or listed.open:
        return f"run '{run_id}' (owner {owner}) admits any identified caller"
    keys = ", ".join(sorted(listed.entries)) or "nobody else"
    return f"run '{run_id}' (owner {owner}) admits its owner and: {keys}"


async def manage_callers(
    run_id: str,
    dht_config: DHTConfig,
    *,
    allow: list[str] | None = None,
    open_run: bool = False,
    ttl_s: float = DEFAULT_TTL_S,
) -> str:
    """Publish the run's caller list (``allow``: peer ids, fingerprints or ``@FILE`` entries; ``open_run``: admit
    any identified caller again) as its owner, or with neither, read it; returns what the run now admits.
    UsageError if this node's identity (``--identity-path``) is not the run's owner, or the run is not found."""
    if allow is not None and open_run:
        raise UsageError("give either --allow or --open, not both")
    # signs with the owner's key, but is a DHT node of its own: the owner's running peer holds its libp2p identity
    identity = Identity.load_or_create(dht_config.identity_path)
    dht = await asyncio.to_thread(
        start_dht,
        dataclasses.replace(dht_config, identity_path=None),
        client_mode=True,
        identity=identity,
    )
    try:
        directory = RunDirectory(dht, run_id, run_owner=dht_config.run_owner)
        if await directory.get_run() is None:
            raise UsageError(
                f"no run '{run_id}' is published in this DHT (check --run-id and --initial-peers)"
            )
        if allow is not None:
            try:
                entries = load_allow_callers(",".join(allow))
            except ValueError as e:
                raise UsageError(str(e).replace("--allow-callers", "--allow")) from None
            await publish_caller_list(directory, CallerList(False, entries), ttl_s=ttl_s)
        elif open_run:
            await publish_caller_list(directory, CallerList(True), ttl_s=ttl_s)
        listed = await read_caller_list(directory)
        if allow is not None or open_run:
            listed = CallerList(open_run, frozenset(entries) if allow is not None else frozenset())
        return describe(run_id, listed, directory.owner)
    finally:
        dht.shutdown()
