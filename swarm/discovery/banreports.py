"""Ban reports: what a trainer publishes when it bans a peer for a proven fault, and how others weigh them.

A trainer that catches a peer (a spot-check two other replicas contradicted, or a reply that failed the trainer's
own checks) bans it for the run and publishes a :class:`BanReport` under :func:`ban_reports_key`, at the subkey
``<its owner marker>/<reported peer id>``: hivemind's signature validator stores it only if the reporter's key
signed it, so a report cannot be forged in another's name, and each reporter holds one report per peer (a new one
replaces its last). A report names the peer, the run, the kind of fault, and the evidence (the step and parameter
digest both replies named, digests of the results that disagreed, their relative distance, the replicas that
agreed); it is small (:data:`MAX_REPORT_BYTES`) and expires (the reporter's ``ttl_s``).

A report is one key's word, and keys are free: no single reporter bans an honest peer. :func:`weigh_reports` tells a
reader which peers to avoid: those reported by ``quorum`` distinct reporters, or by one it trusts (the run's owner,
or itself). A peer with fewer reports is a *suspect*: the trainer checks its own calls to it (every forward is
spot-checked), so a report the reader can verify leads to a ban of its own, and a false one to nothing. In a run
with a caller list only listed keys' reports count.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
from hivemind.utils import get_dht_time

from swarm.discovery.dht import subkey_values
from swarm.discovery.records import RecordError, _parse
from swarm.identity import PEER_ID_HEX, fingerprint_of, is_peer_id, owner_key, peer_id_of

logger = logging.getLogger(__name__)

REPORT_VERSION = 1
# Largest report accepted, encoded (a reader reads every report of the run at each refresh).
MAX_REPORT_BYTES = 2048
# Most reports a reader weighs per read (past it, the rest are left out and logged: reporters' keys are free).
MAX_REPORTS = 4096
MAX_TEXT = 240  # longest reason / microbatch id / witness list kept
KINDS = ("mismatch", "bad_reply")
_DIGEST = re.compile(r"[0-9a-f]{0,64}")


def ban_reports_key(run_id: str) -> str:
    return f"swarm/{run_id}/bans"


@dataclass(frozen=True, kw_only=True)
class BanReport:
    """One reporter's evidence that ``peer_id`` served run ``run_id`` wrongly (its writer is its subkey's key)."""

    peer_id: str  # the reported peer
    run_id: str
    stage: int  # the stage it served
    kind: str  # one of KINDS: "mismatch" (a spot-check two replicas decided), "bad_reply" (its reply failed checks)
    reason: str  # one sentence, for people
    microbatch_id: str = ""  # the call it was caught on ("spot-check" for a recomputed one)
    step: int = -1  # the optimizer step both replies named (-1 = not known)
    param_digest: str = ""  # the parameter digest both replies named
    result_digest: str = ""  # sha256 (hex prefix) of the reported peer's result
    expected_digest: str = ""  # of the result the agreeing replicas returned
    distance: float = 0.0  # relative L2 distance between the two results (0 = not measured)
    witnesses: str = ""  # comma-separated peer ids of the replicas whose results agreed against it
    reported_s: float = 0.0  # DHT time the reporter banned it
    version: int = REPORT_VERSION

    def __post_init__(self):
        if not is_peer_id(self.peer_id):
            raise ValueError(
                f"a ban report names a peer id of {PEER_ID_HEX} hex digits, got {self.peer_id[:40]!r}"
            )
        if self.kind not in KINDS:
            raise ValueError(f"a ban report's kind is one of {KINDS}, got {self.kind[:40]!r}")
        if self.stage < 0 or self.distance < 0 or self.reported_s < 0:
            raise ValueError("a ban report's stage, distance and time must not be negative")
        if not (_DIGEST.fullmatch(self.result_digest) and _DIGEST.fullmatch(self.expected_digest)):
            raise ValueError("a ban report's result digests are hex")
        texts = (self.reason, self.microbatch_id, self.witnesses, self.run_id, self.param_digest)
        if any(len(t) > MAX_TEXT for t in texts):
            raise ValueError(f"a ban report's texts are at most {MAX_TEXT} characters each")

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, value: Any) -> BanReport:
        """RecordError if ``value`` is not a report (malformed, too large)."""
        if len(msgpack.packb(value, use_bin_type=True)) > MAX_REPORT_BYTES:
            raise RecordError(f"a ban report is at most {MAX_REPORT_BYTES} bytes")
        return _parse(cls, value, "ban report")

    @classmethod
    def make(cls, **fields) -> BanReport:
        """A report stamped now, its texts cut to their bound."""
        for name in ("reason", "microbatch_id", "witnesses"):
            if name in fields:
                fields[name] = fields[name][:MAX_TEXT]
        return cls(reported_s=get_dht_time(), **fields)


@dataclass(frozen=True)
class SignedReport:
    """A report as read: who signed it (peer id and fingerprint of the subkey's key) and what it says."""

    reporter: str  # peer id
    reporter_fingerprint: str
    report: BanReport


def parse_reports(values: dict, run_id: str) -> list[SignedReport]:
    """The well-formed, signed reports about run ``run_id`` among the values of its reports key (by subkey). A
    report under no owner marker, under another peer's slot, about another run, malformed or too large is left
    out and logged; so is everything past :data:`MAX_REPORTS`."""
    out: list[SignedReport] = []
    for subkey, value in values.items():
        if len(out) >= MAX_REPORTS:
            logger.warning(
                "run '%s' has over %d ban reports; weighing the first only", run_id, MAX_REPORTS
            )
            break
        key = owner_key(subkey)
        if key is None:
            logger.warning("ignoring an unsigned ban report under subkey %.60r", subkey)
            continue
        reporter = peer_id_of(key)
        try:
            report = BanReport.from_wire(value)
        except RecordError as e:
            logger.warning("ignoring a malformed ban report from %s: %s", reporter, e)
            continue
        slot = subkey.rpartition(b"/")[2].decode(errors="replace")
        if report.run_id != run_id or slot != report.peer_id:
            logger.warning(
                "ignoring a ban report from %s filed for another run or peer: %r", reporter, report
            )
            continue
        out.append(SignedReport(reporter, fingerprint_of(key), report))
    return out


@dataclass(frozen=True)
class Verdict:
    """What a reader makes of the reports about one peer."""

    peer_id: str
    reporters: frozenset[str]  # peer ids of the distinct reporters that count
    avoid: bool  # enough of them (or a trusted one): route no work to it
    reports: tuple[BanReport, ...]


def weigh_reports(
    reports: Iterable[SignedReport],
    *,
    quorum: int,
    trusted: Collection[str] = (),
    admitted: Collection[str] | None = None,
) -> dict[str, Verdict]:
    """Verdicts by reported peer id. A peer is avoided when ``quorum`` distinct reporters reported it, or one whose
    peer id or fingerprint is in ``trusted``; ``admitted`` (peer ids), when given, is who may report at all (the
    run's caller list). A peer's reports about itself do not count."""
    if quorum < 1:
        raise ValueError(f"quorum must be >= 1, got {quorum}")
    by_peer: dict[str, list[SignedReport]] = {}
    for signed in reports:
        if signed.reporter == signed.report.peer_id:
            continue
        if admitted is not None and signed.reporter not in admitted:
            continue
        by_peer.setdefault(signed.report.peer_id, []).append(signed)
    verdicts = {}
    for peer, found in by_peer.items():
        reporters = frozenset(s.reporter for s in found)
        vouched = any(s.reporter in trusted or s.reporter_fingerprint in trusted for s in found)
        verdicts[peer] = Verdict(
            peer, reporters, vouched or len(reporters) >= quorum, tuple(s.report for s in found)
        )
    return verdicts


async def publish_ban_report(directory, report: BanReport, *, ttl_s: float) -> bool:
    """Store ``report`` under this node's slot for the reported peer (signed with ``directory``'s identity); it
    lives ``ttl_s`` seconds. Whether the DHT took it."""
    if report.run_id != directory.run_id:
        raise ValueError(f"a report about run '{report.run_id}' filed in run '{directory.run_id}'")
    identity = directory.identity
    if identity is None:
        raise ValueError("a ban report needs the reporter's identity: this directory only reads")
    return await directory.dht.store(
        ban_reports_key(directory.run_id),
        report.to_wire(),
        get_dht_time() + ttl_s,
        subkey=identity.owner_marker + b"/" + report.peer_id.encode(),
        return_future=True,
    )


async def read_ban_reports(directory) -> list[SignedReport]:
    """The run's live, signed, well-formed ban reports (see :func:`parse_reports`)."""
    return parse_reports(
        await subkey_values(directory.dht, ban_reports_key(directory.run_id)), directory.run_id
    )
