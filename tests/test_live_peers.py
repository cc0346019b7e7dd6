"""What the README says about live peers, checked on real peers in this process (real DHT, real gRPC on port 0):
a killed peer's record expires after its TTL and is no longer routed to, `swarm status` lists every peer and says
whether the replicas at one step agree, export takes the most advanced serving replica and refuses replicas that
disagree, a moved peer loads its new stage's parameters, and a drain ends in time.

The tests that move and drain peers come last: when they ran first, in another module of the same pytest run,
the next module's first Peer.create hung until its 120 s timeout. The cause was a DHT process forked from this
one freeing inherited grpc.aio objects and spinning (fixed in swarm/forking.py); the order is kept as it was."""

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from livepeers import (
    HEARTBEAT_S,
    MODEL,
    NONE,
    RUN,
    TTL_S,
    B,
    assert_same_tensors,
    get_state,
    meta,
    params,
    step_last,
    tokens,
    until,
    wait_for_records,
)

from swarm.coordinator.export import (
    ReplicasDisagree,
    export_run,
    gather_stage_states,
    load_exported,
)
from swarm.coordinator.exportdir import read_export_dir
from swarm.coordinator.status import format_status, print_runs, print_status, status_document
from swarm.discovery.dht import DHTConfig, RunDirectory
from swarm.errors import PeerDraining, StageUnavailable
from swarm.model import build_stage
from swarm.peer.lifecycle import Peer
from swarm.states import PeerState
from swarm.trainer.peerlists import ANSWERED_KEEPS_S
from swarm.trainer.pipeline import Pipeline
from swarm.transport.client import PeerClient

# real peers, a DHT and gRPC servers in this process: the integration tier (tests/conftest.py)
pytestmark = pytest.mark.integration


# ---------------------------------------------------------------------------------------------- TTL


@contextlib.asynccontextmanager
async def routed_pair(keeper, other, run_id: str):
    """A trainer's pipeline over ``run_id`` and the run's directory, once the pipeline routes to both peers of
    stage 0."""
    directory = RunDirectory(keeper.dht, run_id)
    pipeline = Pipeline(directory, RUN)
    try:
        await pipeline.refresh()
        assert set(pipeline.router.peers(0)) == {keeper.peer_id, other.peer_id}
        yield directory, pipeline
    finally:
        await pipeline.close()


def test_a_killed_peers_record_expires_within_its_ttl_and_is_no_longer_routed(peers, loop_thread):
    keeper, victim = peers("ttl", 0), peers("ttl", 0)

    async def body():
        async with routed_pair(keeper, victim, "ttl") as (directory, pipeline):
            killed_at = time.monotonic()
            # killed, not drained: no goodbye, its last heartbeat stays in the DHT
            await victim.shutdown()
            still = await directory.stage_records(0)
            # Its record outlives it: the TTL, not the shutdown, is what removes it.
            assert still[victim.peer_id].state == PeerState.SERVING
            # The last heartbeat came before the kill and lives TTL_S: by TTL_S + HEARTBEAT_S the record must be
            # gone. The claim is about that instant, so ask once it has come (a DHT read that starts then sees
            # the record gone however long the read itself takes on a loaded machine).
            await asyncio.sleep(killed_at + TTL_S + HEARTBEAT_S - time.monotonic())
            after = await directory.stage_records(0)
            await pipeline.refresh()
            return set(after), set(pipeline.router.peers(0)), set(pipeline.records[0])

    listed, routed, known = loop_thread.run(body())
    assert listed == routed == known == {keeper.peer_id}


def test_a_peer_that_answers_stays_routed_while_the_dht_has_lost_its_record(peers, loop_thread):
    """A DHT slow to store or read (one frozen node among its neighbours makes each request to it wait out its
    timeout) loses records of peers that serve. The trainer keeps routing to a peer it knew that answers it (a
    reply or Info of the last ANSWERED_KEEPS_S, or its Info at the refresh), and drops it once it stops answering.
    Here the peer's heartbeat is stopped, so its record really expires in the real DHT while the peer serves."""
    keeper, quiet = peers("sticky", 0), peers("sticky", 0)

    async def body():
        async with routed_pair(keeper, quiet, "sticky") as (directory, pipeline):
            (heartbeat,) = [
                t for t in asyncio.all_tasks() if t.get_name() == f"announce-{quiet.peer_id}"
            ]
            heartbeat.cancel()

            async def unlisted() -> bool:
                await pipeline.refresh()
                return quiet.peer_id not in await directory.stage_records(0)

            await until(unlisted, "its record expires in the DHT", timeout_s=TTL_S * 4)
            # silent past ANSWERED_KEEPS_S: the refresh asks its Info, and it answers
            await asyncio.sleep(ANSWERED_KEEPS_S)
            await pipeline.refresh()
            kept = set(pipeline.records[0]), set(pipeline.router.peers(0))
            # now it refuses: dropped once its last answer is ANSWERED_KEEPS_S old
            await quiet.shutdown()
            await asyncio.sleep(ANSWERED_KEEPS_S)
            await pipeline.refresh()
            return kept, set(pipeline.records[0]), set(pipeline.router.peers(0))

    (kept_records, kept_routed), records, routed = loop_thread.run(body())
    assert kept_records == kept_routed == {keeper.peer_id, quiet.peer_id}
    assert records == routed == {keeper.peer_id}


# ---------------------------------------------------------------------------------------------- status

STATUS_LINE = re.compile(
    r"^  (\S+)\s+(\S+)\s+(\w+)\s+([\d.]+) samples/s\s+in flight (\d+)\s+step (\d+)\s+"
    r"digest ([0-9a-f]{16}|-)\s+(cpu fp32 [\d.]+/[\d.]+ GiB)\s+heartbeat (\d+)s ago$"
)


# Runs the CLI in a process of its own (seconds to import torch and join the DHT): out of the fast tier.
@pytest.mark.slow
def test_swarm_status_lists_every_peer_of_every_stage_with_its_state_and_step(
    peers, loop_thread, boot
):
    # A draining peer stays listed while it announces "draining": its notice window outlasts the test.
    first, leaving = (
        peers("status", 0),
        peers("status", 0, drain_notice_s=60.0, drain_timeout_s=90.0),
    )
    last = peers("status", 1)
    directory = RunDirectory(first.dht, "status")

    async def prepare():
        await step_last(last, 3)
        drain = asyncio.ensure_future(leaving.drain())
        await wait_for_records(
            directory,
            0,
            lambda r: r.get(leaving.peer_id, None) and r[leaving.peer_id].state == "draining",
        )
        await wait_for_records(
            directory, 1, lambda r: r.get(last.peer_id) and r[last.peer_id].step == 3
        )
        return drain

    drain = loop_thread.run(prepare())
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "swarm",
                "status",
                "--run-id",
                "status",
                "--initial-peers",
                *boot,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        loop_thread.loop.call_soon_threadsafe(drain.cancel)  # the task lives on the loop's thread
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (
        f"run 'status': 2 stages, codec none: 1.0x fewer activation bytes than float32, target batch {B} "
        f"samples, config {RUN.fingerprint()}, owner {first.directory.owner}"
    )
    stage_of, listed, serving = None, {}, {}
    assert lines[-1].startswith("bottleneck: stage ")
    for line in lines[1:-1]:
        if header := re.match(r"^stage (\d+): (\d+) peer\(s\), ([\d.]+) samples/s serving, ", line):
            stage_of = int(header.group(1))
            serving[stage_of] = float(header.group(3))
            continue
        row = STATUS_LINE.match(line)
        assert row, line
        peer_id, endpoint, state, _, _, step, _, _, age = row.groups()
        listed[peer_id] = (stage_of, endpoint, state, int(step))
        assert int(age) < 60, line  # its heartbeat is recent: the record's TTL is far shorter
    assert listed == {
        first.peer_id: (0, first.endpoint, "serving", 0),
        leaving.peer_id: (0, leaving.endpoint, "draining", 0),
        last.peer_id: (1, last.endpoint, "serving", 3),
    }
    headers = [re.match(r"^stage (\d+): (\d+) peer\(s\)", line) for line in lines]
    assert [h.groups() for h in headers if h] == [("0", "2"), ("1", "1")]
    named = re.fullmatch(r"bottleneck: stage (\d+) \(([\d.]+) samples/s serving\)", lines[-1])
    assert named and float(named.group(2)) == serving[int(named.group(1))] == min(serving.values())


@pytest.mark.slow
def test_status_watch_prints_one_document_per_period_until_interrupted(peers, loop_thread, boot):
    last = peers("watch", 1)
    directory = RunDirectory(last.dht, "watch")
    loop_thread.run(step_last(last, 1))
    loop_thread.run(
        wait_for_records(directory, 1, lambda r: r.get(last.peer_id) and r[last.peer_id].step == 1)
    )
    argv = ["status", "--run-id", "watch", "--json", "--watch", "0.2", "--initial-peers", *boot]
    # Its own process group: if it must be killed, its DHT child goes too (left alive, that child would hold
    # the pipes open and communicate() would wait for ever). Started with SIGINT ignored, as a command in the
    # background of a script is (and as this suite's process may be: hivemind's averagers set it so): it still
    # stops on SIGINT.
    watcher = subprocess.Popen(
        [sys.executable, "-m", "swarm", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        documents = [json.loads(watcher.stdout.readline()) for _ in range(3)]
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=60) == 130
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(watcher.pid, signal.SIGKILL)
        _, stderr = watcher.communicate(timeout=30)
    assert "Traceback" not in stderr, stderr
    times = [d["time"] for d in documents]
    assert times == sorted(times) and times[2] - times[0] >= 0.4  # one per period, in order
    for document in documents:
        assert (
            document["run_id"] == "watch" and document["bottleneck"] == 0
        )  # no peer serves stage 0
        (replica,) = document["stages"][1]["replicas"]
        assert (replica["peer_id"], replica["step"]) == (last.peer_id, 1)


def test_status_says_whether_the_replicas_at_one_step_hold_the_same_parameters(
    peers, loop_thread, boot, capsys
):
    """Replicas step alone here (no averaging): fed the same microbatches they stay equal, bit for bit; fed
    different ones, they hold different parameters at the same step, and status says so."""
    a, b = peers("agree", 1), peers("agree", 1)
    directory = RunDirectory(a.dht, "agree")

    def both_at(step: int):
        return lambda r: all(
            p.peer_id in r and r[p.peer_id].step == step and r[p.peer_id].param_digest
            for p in (a, b)
        )

    async def status():
        run = await directory.get_run()
        stages = await directory.all_stages(MODEL.num_stages)
        return (
            status_document("agree", run, stages, owner=directory.owner),
            format_status("agree", run, stages, owner=directory.owner),
        )

    async def same_batches():
        await step_last(a, 2)
        await step_last(b, 2)
        await wait_for_records(directory, 1, both_at(2))
        client = PeerClient(a.address)
        try:
            info = await client.info("agree", timeout_s=10)
        finally:
            await client.close()
        await print_status("agree", DHTConfig(initial_peers=boot), as_json=True)
        await print_runs(DHTConfig(initial_peers=boot), as_json=True)
        return (*await status(), info)

    document, text, info = loop_thread.run(same_batches())
    digest = a.executor.param_digest()
    assert b.executor.param_digest() == digest and (info.step, info.param_digest) == (2, digest)
    printed, runs_listed = capsys.readouterr().out.splitlines()  # the status, then the runs list
    runs = {run["run_id"]: run for run in json.loads(runs_listed)["runs"]}
    # every node of the run lists it, each under its own signed entry; all name the one owner
    assert runs["agree"] == {
        "run_id": "agree",
        "num_stages": 2,
        "config": RUN.fingerprint(),
        "owners": [a.directory.owner],
    }
    printed = json.loads(printed)
    assert printed.pop("time") <= document.pop("time")
    for doc in (printed, document):  # read at different moments: the ages differ, each recent
        ages = [r.pop("heartbeat_age_s") for stage in doc["stages"] for r in stage["replicas"]]
        assert ages and all(0 <= age < 60 for age in ages), ages
    assert printed == document and document["owner"] == a.directory.owner
    assert document["run_id"] == "agree" and document["config"] == RUN.fingerprint()
    # Stage 0 has no peer here: it limits the swarm.
    assert document["bottleneck"] == 0 and document["stages"][0]["throughput"] == 0
    assert document["stages"][1]["throughput"] == sum(
        r["throughput"] for r in document["stages"][1]["replicas"]
    )
    assert [(s["stage"], s["agree"], len(s["replicas"])) for s in document["stages"]] == [
        (0, None, 0),
        (1, True, 2),
    ]
    replicas = {r["peer_id"]: r for r in document["stages"][1]["replicas"]}
    assert (
        replicas[a.peer_id]
        == {
            "peer_id": a.peer_id,
            "endpoint": a.endpoint,
            "state": "serving",
            "step": 2,
            "param_digest": digest,
            "throughput": replicas[a.peer_id]["throughput"],
            "in_flight": 0,
            "device": "cpu",  # where its stage computes
            "dtype": "fp32",  # what in (no autocast)
            # its stage's memory estimate, and the RAM the machine had available then
            "memory_bytes": a.memory_bytes,
            "device_memory_bytes": replicas[a.peer_id]["device_memory_bytes"],
            "averaging": False,  # these replicas step alone (the peers fixture's --no-average)
            "reachability": "direct",  # on loopback: dialed back at its start (or the run's first, unchecked)
        }
    )
    assert replicas[a.peer_id]["device_memory_bytes"] > a.memory_bytes > 0
    assert (replicas[b.peer_id]["step"], replicas[b.peer_id]["param_digest"]) == (2, digest)
    lines = text.splitlines()
    assert lines[1].endswith("replicas: no two at one step to compare")
    assert lines[2].endswith("replicas agree (step 2)")
    assert sum(f"step 2      digest {digest}  cpu fp32 " in line for line in lines) == 2

    async def other_batches():
        await step_last(a, 1, seed=50)
        await step_last(b, 1, seed=60)
        await wait_for_records(directory, 1, both_at(3))
        return await status()

    document, text = loop_thread.run(other_batches())
    assert document["stages"][1]["agree"] is False
    digests = {r["peer_id"]: r["param_digest"] for r in document["stages"][1]["replicas"]}
    assert digests == {a.peer_id: a.executor.param_digest(), b.peer_id: b.executor.param_digest()}
    assert len(set(digests.values())) == 2
    header = text.splitlines()[2]
    assert "replicas DISAGREE at step 3: " in header
    assert f"{digests[a.peer_id]} ({a.peer_id})" in header
    assert f"{digests[b.peer_id]} ({b.peer_id})" in header


# ---------------------------------------------------------------------------------------------- export


def test_export_takes_the_most_advanced_live_replica(peers, loop_thread, boot, tmp_path):
    """Replicas step alone here (no averaging), so the stage's two replicas hold different parameters: the
    export must be the more advanced one's, exactly. Past it: a draining replica is passed over (it is leaving,
    and a moving peer's state may already be another stage's), and a dead one (record still there or gone)
    makes the export fall back on the next."""
    first = peers("export", 0)
    ahead = peers("export", 1, drain_notice_s=60.0, drain_timeout_s=90.0)
    behind = peers("export", 1)
    directory = RunDirectory(first.dht, "export")

    async def prepare():
        await step_last(ahead, 3, seed=100)
        await step_last(behind, 1, seed=200)
        await wait_for_records(
            directory,
            1,
            lambda r: {p: x.step for p, x in r.items()} == {ahead.peer_id: 3, behind.peer_id: 1},
        )
        return [params(await get_state(p)) for p in (first, ahead, behind)]

    first_params, ahead_params, behind_params = loop_thread.run(prepare())
    assert not all(torch.equal(ahead_params[k], behind_params[k]) for k in ahead_params)

    out = tmp_path / "export"
    message = loop_thread.run(export_run("export", DHTConfig(initial_peers=boot), str(out)))
    assert "stages at optimizer steps [0, 3]" in message
    load_exported(str(out))  # assembles
    run, states, steps = read_export_dir(out)
    assert run.fingerprint() == RUN.fingerprint() and steps == [0, 3]
    assert_same_tensors(states[0], first_params)
    assert_same_tensors(states[1], ahead_params)

    async def gather():
        states, steps = await gather_stage_states(directory, RUN, timeout_s=10)
        return states[1], steps

    async def drain_ahead():
        drain = asyncio.ensure_future(ahead.drain())
        await wait_for_records(directory, 1, lambda r: r[ahead.peer_id].state == PeerState.DRAINING)
        return drain

    drain = loop_thread.run(drain_ahead())
    stage1, steps = loop_thread.run(gather())
    assert steps == [0, 1]
    assert_same_tensors(stage1, behind_params)

    loop_thread.loop.call_soon_threadsafe(drain.cancel)  # the task lives on the loop's thread
    loop_thread.run(ahead.shutdown())  # dead: its record (draining, step 3) lingers until its TTL
    stage1, steps = loop_thread.run(gather())
    assert steps == [0, 1]
    assert_same_tensors(stage1, behind_params)


def test_export_refuses_replicas_that_disagree_unless_asked_and_checks_what_it_downloads(
    peers, loop_thread, boot, tmp_path
):
    first = peers("split", 0)
    a, b = peers("split", 1), peers("split", 1)
    directory = RunDirectory(first.dht, "split")
    dht = DHTConfig(initial_peers=boot)

    async def prepare():
        # one step each on different microbatches: the same step, different parameters
        await step_last(a, 1, seed=100)
        await step_last(b, 1, seed=200)
        await wait_for_records(
            directory,
            1,
            lambda r: all(
                p.peer_id in r and r[p.peer_id].step == 1 and r[p.peer_id].param_digest
                for p in (a, b)
            ),
        )
        return {p.peer_id: params(await get_state(p)) for p in (a, b)}

    stage1 = loop_thread.run(prepare())
    out = tmp_path / "export"
    with pytest.raises(ReplicasDisagree) as refused:
        loop_thread.run(export_run("split", dht, str(out)))
    message = str(refused.value)
    assert "stage 1's serving replicas disagree at step 1" in message
    assert a.peer_id in message and b.peer_id in message and "--allow-disagreement" in message
    assert not out.exists()

    # asked to: the most advanced replica's parameters (a tie at step 1: the lower peer id, on every read)
    loop_thread.run(export_run("split", dht, str(out), allow_disagreement=True))
    _, states, steps = read_export_dir(out)
    assert steps == [0, 1]
    assert_same_tensors(states[1], stage1[min(a.peer_id, b.peer_id)])

    # A peer whose parameters no longer hash to the digest it announces (written behind its executor's back
    # here; a bug or a lie in life) is not exported from; stage 0 has no other peer.
    with torch.no_grad():
        next(first.executor.stage_module.parameters()).add_(1.0)
    with pytest.raises(StageUnavailable, match="no live peer of stage 0 .* sent a usable state"):
        loop_thread.run(gather_stage_states(directory, RUN, timeout_s=10, allow_disagreement=True))


# ---------------------------------------------------------------------------------------------- move


def test_a_moved_peer_serves_the_new_stages_parameters(peers, loop_thread):
    mover = peers("move", 0, drain_notice_s=0.1)
    other = peers("move", 1)

    async def body():
        await step_last(other, 3)
        await mover.move_to(1, expected_throughput=1.0)
        return await get_state(mover), await get_state(other)

    moved, source = loop_thread.run(body())
    fresh = {k: v for k, v in build_stage(MODEL, 1).state_dict().items()}
    # The replica it loads from has trained: its parameters are not what a fresh stage 1 would hold.
    assert not all(torch.equal(fresh[k], v) for k, v in params(source).items())
    assert mover.stage_index == 1 and mover.state == PeerState.SERVING
    assert_same_tensors(params(moved), params(source))


# ---------------------------------------------------------------------------------------------- drain


async def forward_first(peer: Peer, microbatch_id: str, seed: int):
    """A stage-0 forward that keeps what its backward needs: the peer now holds one cached microbatch."""
    client = PeerClient(peer.address)
    try:
        return await client.forward(
            meta(peer, microbatch_id), [("input", tokens(seed))], NONE, timeout_s=30
        )
    finally:
        await client.close()


async def backward_first(peer: Peer, microbatch_id: str, grad: torch.Tensor):
    client = PeerClient(peer.address)
    try:
        reply = await client.backward(
            meta(peer, microbatch_id), [("grad_output", grad)], NONE, timeout_s=30
        )
        await reply.committed
        return reply
    finally:
        await client.close()


def test_a_drain_serves_held_backwards_refuses_new_work_and_drops_the_rest_after_the_quiet_time(
    peers, loop_thread
):
    idle_s, timeout_s = 1.0, 30.0
    peer = peers("drain", 0, drain_notice_s=0.2, drain_idle_s=idle_s, drain_timeout_s=timeout_s)

    async def body():
        answered = await forward_first(peer, "answered", 1)
        await forward_first(peer, "abandoned", 2)  # its caller is gone: its backward never comes
        assert peer.executor.cached_microbatches == 2
        started = time.monotonic()
        drain = asyncio.ensure_future(peer.drain())
        while peer.admission.accepts_new_work:  # the notice window
            await asyncio.sleep(0.02)
        with pytest.raises(PeerDraining):
            await forward_first(peer, "new", 3)
        # The quiet time counts from the peer's mark of its last call, made before this caller reads the reply:
        # measure from before the call, never after that mark.
        last_call = time.monotonic()
        reply = await backward_first(peer, "answered", torch.ones_like(answered.tensors["output"]))
        await drain
        return reply, time.monotonic() - started, time.monotonic() - last_call

    reply, drain_s, after_last_call_s = loop_thread.run(body())
    assert reply.meta.state == PeerState.DRAINING
    # the held backward counted, once (a full batch here: the stage stepped on it)
    assert (peer.executor.microbatches_applied, peer.executor.step) == (1, 1)
    assert peer.executor.cached_microbatches == 1  # the abandoned one was given up on, not answered
    # It waited for the quiet time after the last call (poll 0.2 s, settle 0.05 s), not the drain timeout.
    assert idle_s <= after_last_call_s <= idle_s + 1.0
    assert drain_s < timeout_s / 3


def test_a_drain_ends_within_its_timeout_when_a_held_backward_never_comes(peers, loop_thread):
    timeout_s = 3.0
    # The quiet time alone would hold the drain for a minute: only the timeout can end it.
    peer = peers(
        "drain-timeout", 0, drain_notice_s=0.2, drain_idle_s=60.0, drain_timeout_s=timeout_s
    )

    async def body():
        await forward_first(peer, "abandoned", 1)
        started = time.monotonic()
        await asyncio.wait_for(peer.drain(), timeout=timeout_s + 5)
        return time.monotonic() - started

    drain_s = loop_thread.run(body())
    assert peer.executor.cached_microbatches == 1
    # The drain keeps 1 s of its timeout for the checkpoint and the exit.
    assert timeout_s - 1.5 <= drain_s <= timeout_s
