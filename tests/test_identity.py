"""Identities and signed DHT records: a node's name derives from its key, only the key's holder writes its records,
and a run's config is its owner's (issue: an open swarm that lets no one in where they don't belong).

The attacks run against real hivemind DHT nodes: an honest node (this swarm's validator, its own key), an attacker
with a key of its own, and a rogue node without any validator (what anyone can run)."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys

import hivemind
import pytest
from hivemind.utils import get_dht_time

from swarm.config import RunConfig
from swarm.discovery.config import DHTConfig
from swarm.discovery.dht import (
    RunDirectory,
    config_key,
    list_runs,
    run_signing_payload,
    sign_run,
    stage_key,
    start_dht,
)
from swarm.discovery.records import RecordError, StageRecord
from swarm.identity import Identity, IdentityError, fingerprint_of, owner_key, peer_id_of
from swarm.model import ModelConfig
from swarm.states import PeerState

pytestmark = pytest.mark.integration

RUN = RunConfig(model=ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16))
HOSTILE_RUN = RunConfig(
    model=ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16), lr=1000.0, max_grad_norm=0.0
)


def test_an_identity_persists_in_its_file_readable_by_its_owner_only(tmp_path):
    path = tmp_path / "keys" / "peer.pem"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = Identity.load_or_create(path)
    assert (again.peer_id, again.fingerprint, again.public_key) == (
        first.peer_id,
        first.fingerprint,
        first.public_key,
    )
    # names derive from the public key, nothing else
    assert first.peer_id == peer_id_of(first.public_key) and len(first.peer_id) == 16
    assert first.fingerprint == fingerprint_of(first.public_key) and len(first.fingerprint) == 32
    assert owner_key(first.owner_marker) == first.public_key
    assert Identity.ephemeral().peer_id != first.peer_id
    assert [p.name for p in path.parent.iterdir()] == ["peer.pem"]  # no temporary file left behind


def test_an_unusable_identity_file_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "peer.pem"
    path.write_text("not a key")
    with pytest.raises(
        IdentityError, match="is not an unencrypted PEM private key.*--identity-path"
    ):
        Identity.load_or_create(path)


def test_the_run_owner_flag_takes_a_fingerprint_only():
    with pytest.raises(ValueError, match="32 lowercase hex digits"):
        DHTConfig(run_owner="alice")
    assert DHTConfig(run_owner="0" * 32).run_owner == "0" * 32


@pytest.fixture(scope="module")
def nodes():
    """An honest node (the bootstrap), an attacker running this swarm's code with its own key, and a rogue node
    running bare hivemind without any validator."""
    honest = start_dht(DHTConfig())
    maddrs = [str(a) for a in honest.get_visible_maddrs()]
    attacker = start_dht(DHTConfig(initial_peers=tuple(maddrs)))
    rogue = hivemind.DHT(initial_peers=maddrs, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield honest, attacker, rogue
    for node in (rogue, attacker, honest):
        node.shutdown()


def _record(peer_id: str, **overrides) -> StageRecord:
    fields = dict(
        peer_id=peer_id,
        endpoint="127.0.0.1:1",
        stage=0,
        state=PeerState.SERVING,
        throughput=10.0,
        in_flight=0,
        step=3,
        config_hash=RUN.fingerprint(),
    )
    return StageRecord(**{**fields, **overrides})


def test_only_a_records_owner_can_write_it(nodes):
    honest, attacker, rogue = nodes
    victim = honest.swarm_identity
    run_id = "impersonation"

    async def go():
        mine = RunDirectory(honest, run_id)
        await mine.announce(_record(victim.peer_id), ttl_s=60)
        fake = _record(
            victim.peer_id, endpoint="10.9.9.9:1", throughput=1e300, step=10**12
        ).to_wire()
        later = get_dht_time() + 600
        key = stage_key(run_id, 0)
        # the attacker writes under the victim's subkey: its validator cannot sign for that key
        over_victim = await attacker.store(
            key, fake, later, subkey=victim.owner_marker, return_future=True
        )
        # a rogue node does the same without any validator, and adds an unsigned record
        rogue_over = await rogue.store(
            key, fake, later, subkey=victim.owner_marker, return_future=True
        )
        unsigned = await rogue.store(
            key, fake, later, subkey=victim.peer_id.encode(), return_future=True
        )
        # the attacker signs a record naming the victim under its own subkey
        named = await attacker.store(
            key, fake, later, subkey=attacker.swarm_identity.owner_marker, return_future=True
        )
        # (a writer's own node keeps what it writes: the store calls say nothing about the honest node)
        del over_victim, rogue_over, unsigned, named
        return await RunDirectory(honest, run_id).stage_records(0)

    seen = asyncio.run(go())
    # An honest reader keeps the victim's real record only: the forgeries under its subkey fail the signature check
    # (where they are stored and where they are read), the unsigned one and the one naming another are dropped.
    assert list(seen) == [victim.peer_id]
    assert (seen[victim.peer_id].endpoint, seen[victim.peer_id].step) == ("127.0.0.1:1", 3)


def test_a_run_config_is_its_owners_and_a_pinned_run_refuses_any_other(nodes, caplog):
    honest, attacker, _ = nodes
    owner = honest.swarm_identity
    run_id = "forged-config"

    async def go():
        created = RunDirectory(honest, run_id)
        await created.publish_run(RUN, ttl_s=600)
        later = get_dht_time() + 600
        # tampering with the owner's signed record (lr 1000, clipping off) breaks its signature
        tampered = sign_run(owner, run_id, RUN)
        tampered["config"] = HOSTILE_RUN.to_dict()
        await attacker.store(
            config_key(run_id),
            tampered,
            later,
            subkey=attacker.swarm_identity.owner_marker,
            return_future=True,
        )
        pinned = await RunDirectory(attacker, run_id, run_owner=owner.fingerprint).get_run()
        unpinned = await RunDirectory(attacker, run_id).get_run()
        # the attacker publishes its own config under the same run id, signed with its own key
        await attacker.store(
            config_key(run_id),
            sign_run(attacker.swarm_identity, run_id, HOSTILE_RUN),
            later + 1,
            subkey=attacker.swarm_identity.owner_marker,
            return_future=True,
        )
        pinned_after = await RunDirectory(honest, run_id, run_owner=owner.fingerprint).get_run()
        with pytest.raises(RecordError) as conflict:
            await RunDirectory(honest, run_id).get_run()
        pinned_to_other = await RunDirectory(honest, run_id, run_owner="f" * 32).get_run()
        return created.owner, pinned, unpinned, pinned_after, conflict.value, pinned_to_other

    with caplog.at_level(logging.WARNING, logger="swarm.discovery.dht"):
        created_owner, pinned, unpinned, pinned_after, conflict, pinned_to_other = asyncio.run(go())
    assert created_owner == owner.fingerprint
    assert pinned == RUN and unpinned == RUN  # the tampered copy was ignored either way
    assert "owner signature does not verify" in caplog.text
    assert pinned_after == RUN
    assert (
        f"signed by key {attacker.swarm_identity.fingerprint}: the run is pinned to owner"
        in caplog.text
    )
    message = str(conflict)
    assert "2 different configs" in message and "pass --run-owner" in message
    assert owner.fingerprint in message and attacker.swarm_identity.fingerprint in message
    assert pinned_to_other is None  # no config of the pinned owner: as if the run did not exist


def test_peers_that_create_one_run_together_make_one_run_and_any_of_them_keeps_it(nodes):
    """Peers started together may each sign the same config as its creator: that is one run, with the same owner
    on every reader. Each refreshes the signed record it adopted under its own subkey."""
    honest, attacker, _ = nodes
    run_id = "created-together"

    async def go():
        first, second = RunDirectory(honest, run_id), RunDirectory(attacker, run_id)
        await asyncio.gather(first.publish_run(RUN, ttl_s=600), second.publish_run(RUN, ttl_s=600))
        reader = RunDirectory(honest, run_id)
        config = await reader.get_run()
        with pytest.raises(ValueError, match="cannot change"):
            await reader.publish_run(HOSTILE_RUN, ttl_s=600)
        return config, reader.owner, await list_runs(honest)

    config, owner, runs = asyncio.run(go())
    both = sorted([honest.swarm_identity.fingerprint, attacker.swarm_identity.fingerprint])
    assert config == RUN and owner == both[0]
    assert sorted(runs[run_id]["owners"]) == both and runs[run_id]["num_stages"] == 2


def test_a_record_signed_over_another_run_id_does_not_verify():
    owner = Identity.ephemeral()
    body = RUN.to_dict()
    signature = owner.sign(run_signing_payload("run-a", body))
    assert owner.private_key.get_public_key().verify(run_signing_payload("run-a", body), signature)
    assert not owner.private_key.get_public_key().verify(
        run_signing_payload("run-b", body), signature
    )


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=120
    )


def test_a_trainer_pinned_to_another_owner_refuses_the_run_and_says_why(nodes):
    """Real CLI: `swarm train --run-owner` with a fingerprint that did not sign the run's config exits 1 with one
    line naming the keys that did and what to check; `swarm status` names the run's owner."""
    honest, _, _ = nodes
    run_id = "pinned-elsewhere"
    asyncio.run(RunDirectory(honest, run_id).publish_run(RUN, ttl_s=600))
    boot = [str(a) for a in honest.get_visible_maddrs()]
    owner = honest.swarm_identity.fingerprint
    wrong = "0" * 32
    result = _cli(
        "train",
        "--run-id",
        run_id,
        "--run-owner",
        wrong,
        "--peers-wait-s",
        "3",
        "--initial-peers",
        *boot,
    )
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert f"has configs only from keys {owner}, not from its pinned owner {wrong}" in last, last
    assert "check --run-owner" in last
    listed = _cli("status", "--list-runs", "--initial-peers", *boot)
    assert (
        f"run '{run_id}': 2 stages, config {RUN.fingerprint()}, owner {owner}" in listed.stdout
    ), listed
