"""The heartbeat's records: the stage a peer serves, and a "starting" record where it is heading."""

from __future__ import annotations

import asyncio

from hivemind.utils import get_dht_time

from swarm.config import RunConfig
from swarm.discovery.records import StageRecord
from swarm.model import ModelConfig
from swarm.peer.announcer import RUN_TTL_FACTOR, Announcer, Serving
from swarm.states import PeerState

RUN = RunConfig(model=ModelConfig(d_model=32, n_heads=2, n_layers=3, seq_len=16, num_stages=3))


class Directory:
    def __init__(self, *, publish_failures: int = 0):
        self.announced: list[tuple[StageRecord, float]] = []
        self.published: list[float] = []  # the TTL of each run refresh that went through
        self.publish_failures = publish_failures  # refreshes to fail first (a DHT hiccup)

    async def announce(self, record: StageRecord, *, ttl_s: float) -> None:
        self.announced.append((record, ttl_s))

    async def publish_run(self, run: RunConfig, *, ttl_s: float) -> bool:
        if self.publish_failures:
            self.publish_failures -= 1
            raise TimeoutError("DHT store timed out")
        self.published.append(ttl_s)
        return True


def announcer(serving=None) -> tuple[Announcer, Directory]:
    directory = Directory()
    return Announcer(
        directory,
        RUN,
        peer_id="p1",
        ttl_s=5.0,
        heartbeat_s=1.0,
        endpoint=lambda: "127.0.0.1:7",
        serving=lambda: serving,
    ), directory


def test_an_arriving_peer_announces_starting_on_its_chosen_stage_only():
    ann, directory = announcer(serving=None)
    assert ann.records() == []
    ann.heading_to(2)
    asyncio.run(ann.announce())
    [(record, ttl_s)] = directory.announced
    assert (record.stage, record.state, record.throughput, record.step) == (
        2,
        PeerState.STARTING,
        0.0,
        0,
    )
    assert record.config_hash == RUN.fingerprint() and ttl_s == 5.0
    StageRecord.from_wire(record.to_wire())  # valid as others will read it


def test_a_moving_peer_announces_both_stages_and_settles_on_the_new_one():
    now = Serving(
        stage_index=0,
        state=PeerState.DRAINING,
        throughput=12.5,
        in_flight=3,
        step=7,
        step_pause_s=0.2,
        param_digest="0123456789abcdef",
    )
    ann, _ = announcer(serving=now)
    ann.heading_to(1, expected_throughput=9.0)
    served, target = ann.records()
    assert (
        served.stage,
        served.state,
        served.throughput,
        served.in_flight,
        served.step,
        served.step_pause_s,
    ) == (0, PeerState.DRAINING, 12.5, 3, 7, 0.2)
    # the digest of the parameters it serves; the stage it heads to has none of its own yet
    assert (served.param_digest, target.param_digest) == ("0123456789abcdef", "")
    assert StageRecord.from_wire(served.to_wire()) == served
    assert (target.stage, target.state, target.throughput, target.endpoint) == (
        1,
        PeerState.STARTING,
        9.0,
        "127.0.0.1:7",
    )
    assert served.last_moved_s == target.last_moved_s == 0.0
    before = get_dht_time()
    ann.settled()
    after = get_dht_time()
    [record] = ann.records()
    assert record.stage == 0
    assert before <= record.last_moved_s <= after  # the cooldown counts from the move, in DHT time
    ann.heading_to(None)  # leaving the swarm: no record anywhere else
    assert len(ann.records()) == 1


def beat(directory: Directory, beats: int, *, ttl_s: float, heartbeat_s: float) -> None:
    """Run a serving peer's heartbeat until it has announced ``beats`` times."""
    serving = Serving(
        stage_index=0, state=PeerState.SERVING, throughput=1.0, in_flight=0, step=0, step_pause_s=0
    )
    ann = Announcer(
        directory,
        RUN,
        peer_id="p1",
        ttl_s=ttl_s,
        heartbeat_s=heartbeat_s,
        endpoint=lambda: "a:1",
        serving=lambda: serving,
    )

    async def main():
        task = asyncio.create_task(ann.run_forever())

        async def announced():
            while len(directory.announced) < beats:
                await asyncio.sleep(0.001)

        # a heartbeat that stopped fails the test, not hangs it
        await asyncio.wait_for(announced(), 30)
        task.cancel()

    asyncio.run(main())


def test_the_heartbeat_refreshes_the_run_config_a_few_times_per_its_lifetime_not_every_beat():
    # ttl 5 s: the run's config lives 60 s and is refreshed every 15 s; 30 beats of 1 ms publish it once
    directory = Directory()
    beat(directory, 30, ttl_s=5.0, heartbeat_s=0.001)
    assert directory.published == [5.0 * RUN_TTL_FACTOR]
    # a refresh that fails is tried again at the next beat, and the beats go on meanwhile
    directory = Directory(publish_failures=2)
    beat(directory, 30, ttl_s=5.0, heartbeat_s=0.001)
    assert (directory.publish_failures, len(directory.published)) == (0, 1)
    # refreshes come RUN_REFRESHES times per lifetime: here every 12 x 0.05 / 4 = 150 ms, about every 15th beat
    directory = Directory()
    beat(directory, 30, ttl_s=0.05, heartbeat_s=0.01)  # 30 beats sleep 300 ms at least
    assert 2 <= len(directory.published) <= 15
