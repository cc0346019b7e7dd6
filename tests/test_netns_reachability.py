"""The reachability check through a real NAT router (deploy/netns/nat.py): a public peer is reachable, a peer
behind NAT is not and announces itself relayed, a peer behind NAT with its ports forwarded is reachable; a trainer
behind NAT leaves the relayed peer out (no peer here relays for others, so it has no relay) and trains.
tests/test_netns_relay.py has the relayed data plane.

Every process runs in its own network namespace; two peers and the trainer sit behind their own NAT router each.
Needs root and nftables (markers netns, nat): skipped with the reason otherwise, a failure under
SWARM_REQUIRE_ROOT_TESTS=1 (CI).
"""

from __future__ import annotations

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
from tests.conftest import peers_on_hosts, status_on_host

pytestmark = [pytest.mark.swarm, pytest.mark.netns, pytest.mark.nat]

# No peer relays for others: the NATed peer stays relayed without a relay, the case trainers must route around.
RUN_FLAGS = [
    "--preset",
    "tiny",
    "--target-batch-size",
    "16",
    "--no-average",
    "--no-relay-for-others",
]
FORWARDED_PORTS = (7000, 7001)  # gRPC and DHT ports of the peer whose router forwards them
STEPS = 2


def test_peers_behind_nat_learn_whether_they_are_reachable(tmp_path):
    with EmulatedNetwork(num_hosts=6, nat_hosts=(3, 4, 5)) as net, ProcessGroup(tmp_path) as group:
        boot, public0, public1, natted, forwarded, trainer_host = net.hosts
        addr_file = tmp_path / "bootstrap.addr"
        start_bootstrap(group, addr_file, where=Where.on(boot))

        peer = peers_on_hosts(group, "nat", addr_file, *RUN_FLAGS)

        # The run's first peer has no one to ask; the next ones ask it (or each other).
        first = peer("public0", public0, 0)
        wait_ready(first, timeout_s=120)
        for port in FORWARDED_PORTS:
            forwarded.forward_port(port)
        procs = {
            "public1": peer("public1", public1, 1),
            "natted": peer("natted", natted, 1),
            # what deploy/README.md tells a volunteer behind a home router: forward the ports, announce the
            # router's public address
            "forwarded": peer(
                "forwarded",
                forwarded,
                1,
                "--port",
                FORWARDED_PORTS[0],
                "--dht-port",
                FORWARDED_PORTS[1],
                "--announce-host",
                forwarded.public_address,
            ),
        }
        for proc in procs.values():
            wait_ready(proc, timeout_s=180)
        assert first.wait_for(r"not checked \(no other serving peer", timeout_s=5)
        assert procs["public1"].wait_for(r"is reachable: peer \w+ dialed it back", timeout_s=5)
        assert procs["forwarded"].wait_for(
            rf"{forwarded.public_address}:{FORWARDED_PORTS[0]} is reachable", timeout_s=5
        )
        line = procs["natted"].wait_for(r"is NOT reachable from the swarm.*", timeout_s=5).group(0)
        # the advice names the address the swarm sees: the router's
        assert f"--announce-host {natted.public_address}" in line, line
        assert f"your call came from {natted.public_address}" in line, line

        document = status_on_host(boot, "nat", addr_file)
        seen = {
            r["endpoint"].rsplit(":", 1)[0]: r["reachability"]
            for stage in document["stages"]
            for r in stage["replicas"]
        }
        assert seen == {
            public0.address: "direct",
            public1.address: "direct",
            natted.address: "relayed",
            forwarded.public_address: "direct",
        }, seen

        # A trainer behind NAT of its own (it only dials out) routes around the relayed peer (it names no relay)
        # and trains.
        trainer = start_trainer(
            group,
            "trainer",
            run_id="nat",
            addr_file=addr_file,
            steps=STEPS,
            where=Where.on(trainer_host),
            microbatch_size=8,
            eval_every_steps=0,
            eval_batches=1,
            max_bytes=2_000_000,
        )
        summary = finished(trainer, timeout_s=180)
        assert summary.steps == STEPS
        assert trainer.wait_for(r"announces itself relayed but names no relay", timeout_s=5)
