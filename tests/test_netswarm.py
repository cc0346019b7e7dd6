"""A real swarm across emulated hosts: training completes through 20 Mbit/s links with int8 on the wire.

Every process (bootstrap, 2 peers, trainer) runs in its own network namespace (deploy/netns/) behind a tbf
limit. The trainer relays every activation and gradient, so its uplink qdisc must have carried the int8
encoding of them: at least 1 byte per element, well under the 4 of fp32. Needs root (marker netns).
"""

from __future__ import annotations

import re
import subprocess

import pytest

from deploy.netns import EmulatedHost, EmulatedNetwork
from swarm.coordinator.launcher import ProcessGroup
from swarm.coordinator.localswarm import (
    Where,
    finished,
    start_bootstrap,
    start_peer,
    start_trainer,
    wait_ready,
)
from swarm.model import MODEL_PRESETS

# Needs root for the namespaces: skipped without, a failure in CI (SWARM_REQUIRE_ROOT_TESTS, tests/conftest.py).
pytestmark = [pytest.mark.swarm, pytest.mark.netns]

RATE_MBIT = 20
MICROBATCH, TARGET_BATCH, STEPS = 8, 16, 3
MICROBATCHES = STEPS * TARGET_BATCH // MICROBATCH


def _tbf_sent_bytes(host: EmulatedHost) -> tuple[str, int]:
    """(rate, bytes sent) of the tbf qdisc on the host's uplink, from `tc -s` inside its namespace."""
    out = host.run(["tc", "-s", "qdisc", "show", "dev", "eth0"]).stdout
    match = re.search(r"qdisc tbf .*? rate (\S+) .*?\n\s*Sent (\d+) bytes", out, re.S)
    assert match, f"no tbf qdisc on {host}: {out}"
    return match.group(1), int(match.group(2))


def _names_left(names: list[str]) -> set[str]:
    netns = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True
    ).stdout
    links = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, check=True
    ).stdout
    present = {line.split()[0] for line in netns.splitlines() if line.strip()}
    present |= {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
    return set(names) & present


def test_int8_swarm_trains_through_20_mbit_links(tmp_path):
    model = MODEL_PRESETS["tiny"]
    with EmulatedNetwork(num_hosts=4, rate_mbit=RATE_MBIT) as net, ProcessGroup(tmp_path) as group:
        names = net.created_names()
        boot, host0, host1, trainer_host = net.hosts
        addr_file = tmp_path / "bootstrap.addr"
        start_bootstrap(group, addr_file, where=Where.on(boot))
        run_flags = [
            "--preset",
            "tiny",
            "--codec",
            "int8",
            "--target-batch-size",
            str(TARGET_BATCH),
        ]
        peers = [
            start_peer(
                group,
                f"peer-s{k}",
                stage=k,
                run_id="net",
                addr_file=addr_file,
                where=Where.on(host),
                run_flags=run_flags,
            )
            for k, host in enumerate((host0, host1))
        ]
        for proc in peers:
            assert wait_ready(proc, timeout_s=90).startswith(
                f"{(host0, host1)[peers.index(proc)].address}:"
            )
        rate, sent_before = _tbf_sent_bytes(trainer_host)
        trainer = start_trainer(
            group,
            "trainer",
            run_id="net",
            addr_file=addr_file,
            steps=STEPS,
            metrics_path=tmp_path / "metrics.jsonl",
            where=Where.on(trainer_host),
            microbatch_size=MICROBATCH,
            eval_every_steps=0,
            eval_batches=1,
            max_bytes=2_000_000,
        )
        summary = finished(trainer, timeout_s=90)
        assert (summary.steps, summary.samples) == (STEPS, STEPS * TARGET_BATCH)
        _, sent_after = _tbf_sent_bytes(trainer_host)
    assert not _names_left(names), "the network left namespaces or links behind"
    assert rate == f"{RATE_MBIT}Mbit"
    # Per microbatch the trainer sends stage 0's output to stage 1 and stage 1's input gradient to stage 0:
    # two (B, T, D) tensors. int8 carries 1 byte per element plus block scales; fp32 would carry 4.
    elements = MICROBATCHES * 2 * MICROBATCH * model.seq_len * model.d_model
    sent = sent_after - sent_before
    assert elements <= sent <= 2 * elements, (
        f"{sent} bytes through the trainer's tbf for {elements} elements"
    )
