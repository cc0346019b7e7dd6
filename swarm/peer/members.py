"""Which callers a peer admits: ``--allow-callers`` read into the prefixes :class:`CallerCheck` matches.

An entry is a caller's peer id (16 hex digits) or fingerprint (32), both printed by the caller at start; a
peer id is its fingerprint's first 16 digits, so either names one key. ``@FILE`` reads entries from FILE,
one or more a line, ``#`` starting a comment. Without the flag the peer is open: any caller with a valid
identity (see :mod:`swarm.transport.callers`).

The run's own list (:mod:`swarm.discovery.callerlist`, published by its owner) applies on top:
:func:`follow_caller_list` keeps the peer's CallerCheck in step with it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

from swarm.discovery.config import KEY_NAME

logger = logging.getLogger(__name__)


def parse_entries(text: str, *, where: str) -> frozenset[str]:
    """The entries of ``text`` (separated by commas or white space); ValueError naming ``where`` and the bad
    entry."""
    entries = set()
    for line in text.splitlines():
        for entry in re.split(r"[,\s]+", line.split("#", 1)[0]):
            if not entry:
                continue
            if not KEY_NAME.fullmatch(entry):
                raise ValueError(
                    f"{where}: {entry[:40]!r} is not a peer id (16 lowercase hex digits) nor a fingerprint (32)"
                )
            entries.add(entry)
    return frozenset(entries)


def check_allow_callers(spec: str | None) -> None:
    """Raise ValueError if ``spec`` (the flag's value) cannot be right, without reading any file."""
    if spec is not None and not spec.startswith("@"):
        if not parse_entries(spec, where="--allow-callers"):
            raise ValueError("--allow-callers names nobody; give peer ids, fingerprints or @FILE")


def load_allow_callers(spec: str | None) -> frozenset[str] | None:
    """The callers ``spec`` admits (None: any identified caller). ValueError if a file is missing or wrong."""
    if spec is None:
        return None
    if not spec.startswith("@"):
        return parse_entries(spec, where="--allow-callers")
    path = Path(spec[1:])
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--allow-callers: cannot read {path}: {e.strerror}") from None
    entries = parse_entries(text, where=str(path))
    if not entries:
        raise ValueError(
            f"--allow-callers: {path} names nobody, so no one could call this peer; list peer ids or "
            f"fingerprints in it"
        )
    return entries


# Seconds between two reads of the run's caller list: how long a key the owner removed may still call.
CALLER_LIST_REFRESH_S = 5.0


async def apply_caller_list(directory, check) -> None:
    """Read the run owner's caller list once and make ``check`` (a CallerCheck) enforce it: the run's peers admit
    only its keys (and the owner's), or anyone identified when there is none. A read that fails keeps the list in
    force (logged); a changed list is logged."""
    # imported here: the config checks above must not import the DHT (hivemind) with PeerConfig
    from swarm.discovery.callerlist import read_caller_list

    try:
        listed = await read_caller_list(directory)
    except Exception as e:  # the DHT is remote: keep the list in force and try again later
        logger.warning("could not read run '%s''s caller list: %s", directory.run_id, e)
        return
    admitted = None if listed is None else listed.admitted(directory.owner)
    now = None if admitted is None else tuple(sorted(admitted))
    if now != check.run_allowed:
        logger.info(
            "run '%s' admits %s",
            directory.run_id,
            "any identified caller" if now is None else f"{len(now)} listed keys (its caller list)",
        )
        check.run_allowed = now


async def follow_caller_list(directory, check, *, every_s: float = CALLER_LIST_REFRESH_S) -> None:
    """:func:`apply_caller_list` every ``every_s`` seconds, until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        await apply_caller_list(directory, check)
