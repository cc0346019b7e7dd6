"""The relayed data plane through real NAT routers (deploy/netns/nat.py): a stage-1 peer and the trainer sit behind
NAT routers of their own; the peer is served through a relay (swarm.transport.relay) that one of the two public
stage-0 peers lends it, and keeps serving through the other when its relay is killed mid-run. And a replica behind
NAT averages with a reachable one (the default mode): the two end as one model.

Every process runs in its own network namespace. Needs root and nftables (markers netns, nat): skipped with the
reason otherwise, a failure under SWARM_REQUIRE_ROOT_TESTS=1 (CI).
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from deploy.netns import EmulatedNetwork
from swarm.coordinator.launcher import ProcessGroup
from swarm.coordinator.localswarm import (
    Where,
    finished,
    start_bootstrap,
    start_trainer,
    wait_ready,
)
from tests.conftest import SOLO_PEER_FLAGS, TEST_TRAINER, peers_on_hosts, status_on_host

pytestmark = [pytest.mark.swarm, pytest.mark.netns, pytest.mark.nat]

STEPS = 16
KILL_AT_STEP = 5
LENDS = r"relay (\w+) lends this peer the endpoint (\S+)"


def _summary_count(proc, pattern: str) -> float:
    """The number ``pattern``'s group 1 reads in ``proc``'s last line that matches it."""
    found = [m for line in proc.lines if (m := re.search(pattern, line))]
    assert found, f"{proc.name} never printed /{pattern}/; see {proc.log_path}"
    return float(found[-1].group(1))


def test_a_peer_behind_nat_serves_through_a_relay_and_survives_its_death(tmp_path):
    with EmulatedNetwork(num_hosts=6, nat_hosts=(4, 5)) as net, ProcessGroup(tmp_path) as group:
        boot, relay_a, relay_b, public1, natted_host, trainer_host = net.hosts
        addr_file = tmp_path / "bootstrap.addr"
        start_bootstrap(group, addr_file, where=Where.on(boot))

        peer = peers_on_hosts(group, "relay", addr_file, *SOLO_PEER_FLAGS, "--no-rebalance")

        relays = {"relay_a": peer("relay_a", relay_a, 0)}
        wait_ready(relays["relay_a"], timeout_s=180)
        relays["relay_b"] = peer("relay_b", relay_b, 0)
        other = peer("public1", public1, 1, "--no-relay-for-others")
        natted = peer("natted", natted_host, 1)
        for proc in (*relays.values(), other, natted):
            wait_ready(proc, timeout_s=240)
        assert natted.wait_for(r"is NOT reachable from the swarm", timeout_s=5)
        first = natted.wait_for(LENDS, timeout_s=60)
        relay_id, endpoint = first.group(1), first.group(2)
        # the endpoint is on a public relay (its host tells which), announced as the NATed peer's own
        hosts = {relay_a.address: "relay_a", relay_b.address: "relay_b"}
        used = hosts[endpoint.rsplit(":", 1)[0]]
        assert relays[used].wait_for(rf"relay: lends {re.escape(endpoint)} to peer", timeout_s=5)

        trainer = start_trainer(
            group,
            "trainer",
            run_id="relay",
            addr_file=addr_file,
            steps=STEPS,
            where=Where.on(trainer_host),
            max_bytes=2_000_000,
            **TEST_TRAINER,
        )
        trainer.wait_for(rf"^step {KILL_AT_STEP}/", timeout_s=300)
        mark = len(natted.lines)
        relays[used].signal(signal.SIGKILL)  # the relay dies with the connections it carried
        # The stage's other peer leaves too (drained): from here the trainer's every stage-1 call must reach the
        # NATed peer through a second relay, so the run finishes only if that works (it waits for an empty stage).
        group.stop("public1")
        lost = natted.wait_for(
            r"was lost.*looking for another relay", timeout_s=60, after_line=mark
        )
        again = natted.wait_for(LENDS, timeout_s=60, after_line=mark)
        assert again.group(1) != relay_id and lost
        survivor = next(name for name in relays if name != used)

        summary = finished(trainer, timeout_s=600)
        assert summary.steps == STEPS
        assert summary.microbatches == summary.microbatches_started == 2 * STEPS, summary
        # Every commit of the NATed peer was confirmed, through its second relay if the first died with it. The
        # killed relay is itself a stage-0 peer: a gradient it held when it died cannot be confirmed (one CI run
        # in many), and is computed again elsewhere (counted above); the trainer names the stage of each.
        unasked = [
            int(m.group(1))
            for line in trainer.lines
            if (m := re.search(r"stage (\d+) could not be asked whether it counted", line))
        ]
        assert summary.unconfirmed_commits == len(unasked), (summary, unasked)
        assert set(unasked) <= {0}, (
            f"stage 1 left commits unconfirmed: {unasked}; see {trainer.log_path}"
        )
        # Learning, on the validation windows: the replicas of a stage step on their own here (--no-average), so
        # the last steps' training losses mix drifting replicas (one CI run: 5.72 over the last 5 steps, validation
        # 4.17 from 5.60).
        assert summary.val_loss < summary.initial_loss, summary

        # The NATed peer served microbatches, and callers reached it through the surviving relay (the only way
        # left to stage 1): its summary after a drain counts them, and the relay's counts the bytes it copied.
        group.stop("natted")
        served = _summary_count(natted, r"\((\d+) microbatches in all\)")
        assert served > 0, served
        group.stop(survivor)
        relayed_mb = _summary_count(
            relays[survivor], r"relays for \d+ peers \(\d+ connections, ([\d.]+) MB"
        )
        assert relayed_mb > 0, relayed_mb


AVERAGED_STEPS = 8


def test_a_replica_behind_nat_averages_with_a_reachable_one_into_one_model(tmp_path):
    """Averaging on (the default): nobody can dial the NATed replica, yet it averages with its reachable peer
    (hivemind's all-reduce runs over the libp2p connections the NATed peer opened itself), so every step of the
    stage averages both replicas' samples and they end as one model."""
    with EmulatedNetwork(num_hosts=4, nat_hosts=(3,)) as net, ProcessGroup(tmp_path) as group:
        boot, public0, public1, natted_host = net.hosts
        addr_file = tmp_path / "bootstrap.addr"
        start_bootstrap(group, addr_file, where=Where.on(boot))
        flags = [f for f in SOLO_PEER_FLAGS if f != "--no-average"]
        peer = peers_on_hosts(group, "nat-avg", addr_file, *flags, "--no-rebalance")
        first = peer("public0", public0, 0)  # the relay
        wait_ready(first, timeout_s=180)
        reachable = peer("public1", public1, 1, "--no-relay-for-others")
        wait_ready(reachable, timeout_s=240)
        natted = peer("natted", natted_host, 1)
        wait_ready(natted, timeout_s=240)

        trainer = start_trainer(
            group,
            "trainer",
            run_id="nat-avg",
            addr_file=addr_file,
            steps=AVERAGED_STEPS,
            where=Where.on(boot),
            max_bytes=2_000_000,
            **TEST_TRAINER,
        )
        summary = finished(trainer, timeout_s=600)
        assert summary.steps == AVERAGED_STEPS and summary.unconfirmed_commits == 0, summary
        assert summary.microbatches == summary.microbatches_started == 2 * AVERAGED_STEPS, summary
        assert summary.val_loss < summary.initial_loss, summary

        # Stage 1's replicas stand at the last step with equal parameters: their records, as `swarm status` reads
        # them, polled until both announce that step's digest (a replica rehashes in its step loop; each reading
        # is a process of its own), for at most a minute.
        def stage_1() -> dict:
            document = status_on_host(boot, "nat-avg", addr_file)
            return next(s for s in document["stages"] if s["stage"] == 1)

        deadline = time.monotonic() + 60
        while True:
            stage = stage_1()
            steps = {r["step"] for r in stage["replicas"]}
            if (steps == {AVERAGED_STEPS} and stage["agree"]) or time.monotonic() > deadline:
                break
        replicas = {r["peer_id"]: (r["step"], r["param_digest"]) for r in stage["replicas"]}
        assert len(replicas) == 2 and stage["agree"] is True, stage
        assert {step for step, _ in replicas.values()} == {AVERAGED_STEPS}, replicas

        # Both served, and no sample of the NATed one was left out of a step (no lone or partial step, no group
        # that assembled without it)
        for name in ("natted", "public1"):
            group.stop(name)
        served = {
            p.name: _summary_count(p, r"\((\d+) microbatches in all\)") for p in (natted, reachable)
        }
        assert all(count > 0 for count in served.values()), served
        # (a replica that held none of a batch may find its peer one step on and load its state: nothing lost)
        lost = [
            line
            for line in natted.lines
            if re.search(r"\(([1-9]\d*) samples of its own left out|without its peers", line)
        ]
        assert not lost, lost
