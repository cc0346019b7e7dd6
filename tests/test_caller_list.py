"""The run owner's caller list (real peers, real DHT, real gRPC): once the owner publishes one, the run's peers
admit only its keys and the owner's; nobody else can publish or fake it; publishing "open" opens the run again."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from hivemind.utils import get_dht_time
from livepeers import RUN

from swarm.deadline import timeout
from swarm.discovery.callerlist import (
    CallerList,
    caller_list_key,
    publish_caller_list,
    read_caller_list,
)
from swarm.discovery.config import DHTConfig
from swarm.discovery.dht import RunDirectory
from swarm.errors import NotAdmitted, UsageError
from swarm.identity import Identity
from swarm.peer.config import PeerConfig
from swarm.peer.lifecycle import Peer
from swarm.peer.members import apply_caller_list, follow_caller_list
from swarm.trainer.pipeline import Pipeline
from swarm.transport.callers import CallerToken
from swarm.transport.client import PeerClient

pytestmark = pytest.mark.integration

LISTED, STRANGER = Identity.ephemeral(), Identity.ephemeral()


async def info(peer, identity: Identity):
    client = PeerClient(peer.address, token=CallerToken(identity))
    try:
        return await client.info(peer.run_id, timeout_s=10)
    finally:
        await client.close()


def test_the_owners_list_decides_who_the_runs_peers_admit(peers, loop_thread):
    owner = peers("callers", 1)  # publishes the run: its key owns it
    other = peers("callers", 0)
    assert owner.directory.owner == owner.identity.fingerprint != other.identity.fingerprint

    async def body():
        # an open run: anyone identified, and a trainer routes to every peer
        assert (await info(other, STRANGER)).stage == 0
        pipeline = Pipeline(other.directory, RUN)
        await pipeline.refresh()
        assert set(pipeline.records[0]) == {other.peer_id}
        # a peer that is not the owner cannot publish the list, nor fake one under its own key
        with pytest.raises(UsageError, match="only the owner"):
            await publish_caller_list(
                other.directory, CallerList(False, frozenset({STRANGER.peer_id})), ttl_s=60
            )
        fake = CallerList(False, frozenset({STRANGER.peer_id})).to_wire()
        assert await other.dht.store(
            caller_list_key("callers"),
            fake,
            get_dht_time() + 60,
            subkey=other.identity.owner_marker,
            return_future=True,
        )
        assert await read_caller_list(other.directory) is None  # the fake is not the owner's
        await publish_caller_list(
            owner.directory, CallerList(False, frozenset({LISTED.peer_id})), ttl_s=60
        )
        # a peer that reads it (here at once; every few seconds on its own) admits the listed key and the owner's
        await apply_caller_list(other.directory, other.caller_check)
        assert (await info(other, LISTED)).stage == 0
        assert (await info(other, owner.identity)).stage == 0
        with pytest.raises(NotAdmitted, match="not on the run's caller list"):
            await info(other, STRANGER)
        # a trainer routes only to listed peers (the owner's is: its key is always admitted)
        await pipeline.refresh()
        assert not pipeline.records[0] and set(pipeline.records[1]) == {owner.peer_id}
        await pipeline.close()
        # the owner opens the run again; the peer's own loop picks it up
        await publish_caller_list(owner.directory, CallerList(True), ttl_s=60)
        follower = asyncio.ensure_future(
            follow_caller_list(other.directory, other.caller_check, every_s=0.1)
        )
        try:
            async with timeout(30):
                while other.caller_check.run_allowed is not None:
                    await asyncio.sleep(0.1)  # the loop's period: it re-reads the list
        finally:
            follower.cancel()
        assert (await info(other, STRANGER)).stage == 0

    loop_thread.run(body())


def test_a_list_is_refused_for_a_run_that_is_not_there(peers, loop_thread):
    peer = peers("callers-missing", 1)

    async def body():
        with pytest.raises(UsageError, match="not in the DHT"):
            await publish_caller_list(
                RunDirectory(peer.dht, "no-such-run"), CallerList(True), ttl_s=60
            )

    loop_thread.run(body())


def test_a_caller_list_from_the_wire_is_validated():
    assert CallerList.from_wire({"open": False, "callers": [LISTED.peer_id]}).entries == {
        LISTED.peer_id
    }
    for bad in (None, {"open": "yes"}, {"open": False, "callers": ["XYZ"]}, {"open": True}):
        with pytest.raises(ValueError):
            CallerList.from_wire(bad)


def test_swarm_callers_publishes_as_the_owner_only(loop_thread, boot, tmp_path):
    """The CLI, run with the owner's key file, sets the list the run's peers enforce; with another key it refuses."""
    owner_key = tmp_path / "owner.pem"
    config = PeerConfig(
        run_id="callers-cli",
        stage=1,
        rebalance=False,
        dht=DHTConfig(initial_peers=boot, identity_path=str(owner_key)),
    )
    peer = loop_thread.run(Peer.create(config, run=RUN))
    try:

        def cli(*args):
            return subprocess.run(
                [sys.executable, "-m", "swarm", "callers", "--run-id", "callers-cli"]
                + [a for addr in boot for a in ("--initial-peers", addr)]
                + list(args),
                capture_output=True,
                text=True,
                timeout=120,
            )

        refused = cli("--identity-path", str(tmp_path / "someone.pem"), "--allow", LISTED.peer_id)
        assert refused.returncode == 2 and "only the owner" in refused.stderr, refused.stderr
        done = cli("--identity-path", str(owner_key), "--allow", LISTED.peer_id)
        assert done.returncode == 0, done.stderr
        assert f"admits its owner and: {LISTED.peer_id}" in done.stdout
        loop_thread.run(apply_caller_list(peer.directory, peer.caller_check))
        assert peer.caller_check.run_allowed == tuple(
            sorted({LISTED.peer_id, peer.identity.fingerprint})
        )
        shown = cli()
        assert f"admits its owner and: {LISTED.peer_id}" in shown.stdout, shown.stderr
    finally:
        loop_thread.run(peer.shutdown())
