"""The run's caller list: which keys the run's peers admit, published by the run's owner (``swarm callers``).

A run is open (its peers admit any identified caller) until its owner publishes a list; from then on every peer of
the run admits only the keys on it and the owner's own, re-reading it every few seconds. The list is stored under
the owner's marked subkey of :func:`caller_list_key`, so hivemind's signature validator lets nobody else write it,
and readers take only the record whose signer is the run's owner (as the run config names it): a list from any
other key is ignored and logged. Publishing ``open`` opens the run again. Entries are peer ids or fingerprints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from swarm.discovery.config import KEY_NAME
from swarm.discovery.dht import RunDirectory, subkey_values
from swarm.errors import UsageError
from swarm.identity import fingerprint_of, owner_key

logger = logging.getLogger(__name__)

# Most entries a list may hold (a record is read by every peer every few seconds).
MAX_ENTRIES = 10_000


def caller_list_key(run_id: str) -> str:
    return f"swarm/{run_id}/callers"


@dataclass(frozen=True)
class CallerList:
    """What the run's owner published: ``open`` (anyone identified) or the ``entries`` admitted."""

    open: bool
    entries: frozenset[str] = frozenset()
    published_s: float = 0.0  # DHT time it was published

    def admitted(self, owner: str) -> frozenset[str] | None:
        """The prefixes a peer admits under this list (the owner's fingerprint always), None when open."""
        return None if self.open else self.entries | {owner}

    def to_wire(self) -> dict:
        return {"open": self.open, "callers": sorted(self.entries), "published_s": self.published_s}

    @classmethod
    def from_wire(cls, value) -> CallerList:
        """ValueError with a sentence if ``value`` is not a caller list."""
        if not isinstance(value, dict) or not isinstance(value.get("open"), bool):
            raise ValueError(f"not a caller list: {str(value)[:80]!r}")
        entries = value.get("callers")
        if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
            raise ValueError(f"a caller list needs a list of at most {MAX_ENTRIES} callers")
        bad = [e for e in entries if not (isinstance(e, str) and KEY_NAME.fullmatch(e))]
        if bad:
            raise ValueError(f"caller list entries are not peer ids or fingerprints: {bad[:3]!r}")
        published = value.get("published_s", 0.0)
        if not isinstance(published, int | float):
            raise ValueError("a caller list's published_s must be a number")
        return cls(open=value["open"], entries=frozenset(entries), published_s=float(published))


async def publish_caller_list(
    directory: RunDirectory, callers: CallerList, *, ttl_s: float
) -> None:
    """Publish ``callers`` as the run's list. Only the run's owner can: UsageError for any other identity, or when
    the run is not in the DHT. The list lives ``ttl_s`` seconds; publish it again before then."""
    if await directory.get_run() is None:
        raise UsageError(f"run '{directory.run_id}' is not in the DHT: start it first")
    identity = directory.identity
    if identity is None or identity.fingerprint != directory.owner:
        raise UsageError(
            f"only the owner of run '{directory.run_id}' (key {directory.owner}) can publish its caller list; run "
            f"this with --identity-path pointing at the key that created the run"
        )
    stored = await directory.dht.store(
        caller_list_key(directory.run_id),
        CallerList(callers.open, callers.entries, get_dht_time()).to_wire(),
        get_dht_time() + ttl_s,
        subkey=identity.owner_marker,
        return_future=True,
    )
    if not stored:
        raise UsageError(f"the DHT refused run '{directory.run_id}''s caller list; try again")


async def read_caller_list(directory: RunDirectory) -> CallerList | None:
    """The list the run's owner published (None: none, so the run is open). Needs the run's owner known
    (``directory.get_run()`` read first); lists signed by other keys are ignored and logged."""
    if directory.owner is None:
        return None
    found = None
    for subkey, value in (
        await subkey_values(directory.dht, caller_list_key(directory.run_id))
    ).items():
        key = owner_key(subkey)
        if key is None or fingerprint_of(key) != directory.owner:
            logger.warning(
                "ignoring a caller list of run '%s' not signed by its owner %s",
                directory.run_id,
                directory.owner,
            )
            continue
        try:
            found = CallerList.from_wire(value)
        except ValueError as e:
            logger.warning("ignoring run '%s''s malformed caller list: %s", directory.run_id, e)
    return found
