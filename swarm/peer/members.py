"""Which callers a peer admits: ``--allow-callers`` read into the prefixes :class:`CallerCheck` matches.

An entry is a caller's peer id (16 hex digits) or fingerprint (32), both printed by the caller at start; a
peer id is its fingerprint's first 16 digits, so either names one key. ``@FILE`` reads entries from FILE,
one or more a line, ``#`` starting a comment. Without the flag the peer is open: any caller with a valid
identity (see :mod:`swarm.transport.callers`).
"""

from __future__ import annotations

import re
from pathlib import Path

_ENTRY = re.compile(r"[0-9a-f]{16}(?:[0-9a-f]{16})?")


def parse_entries(text: str, *, where: str) -> frozenset[str]:
    """The entries of ``text`` (separated by commas or white space); ValueError naming ``where`` and the bad
    entry."""
    entries = set()
    for line in text.splitlines():
        for entry in re.split(r"[,\s]+", line.split("#", 1)[0]):
            if not entry:
                continue
            if not _ENTRY.fullmatch(entry):
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
