"""Caller tokens, the CallerCheck that admits them, the --allow-callers list, and peer certificates (unit: no
server; the clock is the test's)."""

from __future__ import annotations

import pytest

from swarm.errors import NotAdmitted, Unauthenticated
from swarm.identity import Identity, certified_key
from swarm.peer.config import PeerConfig
from swarm.peer.members import load_allow_callers
from swarm.transport import callers
from swarm.transport.callers import CallerCheck, CallerToken
from swarm.transport.security import make_certificate

CALLER, OTHER = Identity.ephemeral(), Identity.ephemeral()
CALLEE = "0123456789abcdef"


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def with_header(metadata, key, value):
    return tuple((k, value if k == key else v) for k, v in metadata)


def test_a_valid_token_names_its_caller_and_is_checked_once():
    clock = Clock()
    check = CallerCheck(CALLEE, clock=clock)
    metadata = CallerToken(CALLER, clock=clock).metadata(CALLEE)
    assert check.caller(metadata) == CALLER.fingerprint
    assert len(check._verified) == 1
    clock.now += 10
    assert check.caller(metadata) == CALLER.fingerprint  # remembered, not verified again
    assert len(check._verified) == 1


def test_the_caller_renews_its_token_and_the_peer_refuses_an_old_one():
    clock = Clock()
    token = CallerToken(CALLER, clock=clock)
    first = token.metadata(CALLEE)
    clock.now += callers.TOKEN_RENEW_S - 1
    assert token.metadata(CALLEE) is first
    clock.now += 2
    assert token.metadata(CALLEE) != first
    check = CallerCheck(CALLEE, clock=clock)
    check.caller(first)  # still within its age
    clock.now += callers.TOKEN_MAX_AGE_S
    with pytest.raises(Unauthenticated, match="dated -3"):
        check.caller(first)  # remembered as valid, but past its expiry: checked again and refused


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda m: (), "no caller token"),
        (lambda m: m[:2], "no caller token"),
        (
            lambda m: with_header(m, callers.KEY_HEADER, OTHER.public_key),
            "signature does not match",
        ),
        (
            lambda m: with_header(m, callers.SIGNATURE_HEADER, OTHER.sign(b"anything")),
            "signature does not match",
        ),
        (
            lambda m: with_header(m, callers.TOKEN_HEADER, "v1 fedcba9876543210 1800000000000"),
            "made for peer 'fedcba9876543210'",
        ),
        (lambda m: with_header(m, callers.TOKEN_HEADER, "v2 x y"), "malformed"),
        (lambda m: with_header(m, callers.KEY_HEADER, b"k" * 5000), "over 4096 bytes"),
        (lambda m: with_header(m, callers.TOKEN_HEADER, b"binary"), "no caller token"),
    ],
    ids=[
        "none",
        "no-signature",
        "other-key",
        "forged-signature",
        "other-callee",
        "malformed",
        "oversized",
        "wrong-type",
    ],
)
def test_a_missing_forged_or_misdirected_token_is_refused(change, why):
    clock = Clock()
    check = CallerCheck(CALLEE, clock=clock)
    metadata = CallerToken(CALLER, clock=clock).metadata(CALLEE)
    with pytest.raises(Unauthenticated, match=why):
        check.caller(change(metadata))


def test_a_token_made_for_one_peer_is_refused_by_another():
    clock = Clock()
    metadata = CallerToken(CALLER, clock=clock).metadata(CALLEE)
    with pytest.raises(Unauthenticated, match="a token is good at one peer only"):
        CallerCheck("fedcba9876543210", clock=clock).caller(metadata)


@pytest.mark.parametrize("skew_s", [-callers.TOKEN_MAX_AGE_S - 1, callers.TOKEN_MAX_EARLY_S + 1])
def test_a_token_dated_too_far_from_the_peers_clock_is_refused(skew_s):
    clock = Clock()
    metadata = CallerToken(CALLER, clock=lambda: clock.now + skew_s).metadata(CALLEE)
    with pytest.raises(Unauthenticated, match="check the caller's clock"):
        CallerCheck(CALLEE, clock=clock).caller(metadata)


def test_the_allow_list_admits_listed_peer_ids_and_fingerprints_only():
    clock = Clock()
    check = CallerCheck(CALLEE, allowed={CALLER.peer_id}, clock=clock)
    assert check.caller(CallerToken(CALLER, clock=clock).metadata(CALLEE)) == CALLER.fingerprint
    with pytest.raises(NotAdmitted, match=OTHER.fingerprint):
        check.caller(CallerToken(OTHER, clock=clock).metadata(CALLEE))
    by_fingerprint = CallerCheck(CALLEE, allowed={OTHER.fingerprint}, clock=clock)
    assert by_fingerprint.caller(CallerToken(OTHER, clock=clock).metadata(CALLEE))


def test_allow_callers_reads_ids_from_the_flag_or_a_file(tmp_path):
    assert load_allow_callers(None) is None
    assert load_allow_callers(f"{CALLER.peer_id},{OTHER.fingerprint}") == {
        CALLER.peer_id,
        OTHER.fingerprint,
    }
    listed = tmp_path / "callers"
    listed.write_text(f"# trainers\n{CALLER.peer_id}  # ours\n\n{OTHER.peer_id}\n")
    assert load_allow_callers(f"@{listed}") == {CALLER.peer_id, OTHER.peer_id}
    listed.write_text("# nobody yet\n")
    with pytest.raises(ValueError, match="names nobody"):
        load_allow_callers(f"@{listed}")
    with pytest.raises(ValueError, match="cannot read"):
        load_allow_callers(f"@{tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="'NOT-AN-ID' is not a peer id"):
        PeerConfig(allow_callers="NOT-AN-ID")
    with pytest.raises(ValueError, match="names nobody"):
        PeerConfig(allow_callers=" , ")


def test_a_peer_certificate_certifies_its_identity_key():
    cert = make_certificate(CALLER)
    assert certified_key(cert) == CALLER.public_key
    assert certified_key(make_certificate(OTHER)) != CALLER.public_key
    assert certified_key("not a certificate") is None
