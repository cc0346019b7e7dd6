"""A peer whose DHT node is gone says so and leaves (swarm.discovery.watch): trainers can no longer find it and it
can no longer find its stage, so serving on in silence helps no one. Real hivemind nodes, a real peer process."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import SOLO_PEER_FLAGS, TEST_TRAINER

from swarm.discovery.config import DHTConfig
from swarm.discovery.dht import start_dht
from swarm.discovery.watch import DHTWatch
from swarm.peer.lifecycle import EXIT_DHT_LOST


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def name_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


def dht_process_of(pid: int) -> tuple[int, int]:
    """(the DHT node's process, its p2pd) among the children of process ``pid``: the node runs p2pd."""
    for child in children(pid):
        daemons = [c for c in children(child) if name_of(c) == "p2pd"]
        if daemons:
            return child, daemons[0]
    raise AssertionError(f"no child of {pid} runs p2pd")


def gone_within(pid: int, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while name_of(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)  # a process that is not ours to wait on: /proc is all there is to watch
    return True


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_node(proc, node: int) -> tuple[int, float]:
    """SIGKILL ``proc``'s DHT process ``node``; once ``proc`` said why, wait for its exit: (its code, seconds after
    the kill)."""
    t0 = time.monotonic()
    os.kill(node, signal.SIGKILL)
    proc.wait_for(
        rf"lost its DHT node: its DHT process \(pid {node}\) was killed by signal 9", timeout_s=30
    )
    return proc.popen.wait(timeout=120), time.monotonic() - t0


def test_the_watch_reports_a_node_whose_process_died(loop_thread):
    dht = start_dht(DHTConfig())
    _, p2pd = dht_process_of(os.getpid())
    try:

        async def watch_it_die() -> list[str]:
            lost, reasons = asyncio.Event(), []
            watch = DHTWatch(
                dht, silent_s=60.0, on_lost=lambda why: (reasons.append(why), lost.set())
            )
            watch.start()
            os.kill(dht.pid, signal.SIGKILL)
            await asyncio.wait_for(lost.wait(), 30.0)
            return reasons

        assert loop_thread.run(watch_it_die()) == [
            f"its DHT process (pid {dht.pid}) was killed by signal 9"
        ]
    finally:
        dht.shutdown()
        kill_quietly(p2pd)  # (its node's end is gone; it would exit at its idle timeout)


def test_the_watch_loses_a_node_that_answers_nothing_for_its_silence_bound(loop_thread):
    """A call the node never answers times out; the node is lost once nothing was answered for ``silent_s``, and an
    answer in between starts that count again."""

    async def scenario() -> tuple[list[str], list[str], list[str]]:
        reasons: list[str] = []
        watch = DHTWatch(object(), silent_s=0.3, on_lost=reasons.append)
        never = asyncio.get_running_loop().create_future  # a request the node never reads
        with pytest.raises(asyncio.TimeoutError):
            await watch.ask(never(), timeout_s=0.05)
        early = list(reasons)  # nothing answered for 0.05 s only: not lost yet
        answered = asyncio.get_running_loop().create_future()
        answered.set_result(True)
        await asyncio.sleep(0.3)  # silence past the bound, but the next call is answered
        assert await watch.ask(answered, timeout_s=1.0) is True
        after_answer = list(reasons)
        with pytest.raises(asyncio.TimeoutError):
            await watch.ask(never(), timeout_s=0.35)  # 0.35 s of silence: past the bound
        return early, after_answer, reasons

    early, after_answer, reasons = loop_thread.run(scenario())
    assert early == [] and after_answer == []
    assert len(reasons) == 1 and reasons[0].startswith("its DHT node has answered nothing for")


@pytest.mark.swarm
def test_a_peer_and_a_trainer_whose_dht_processes_die_say_so_and_exit_for_their_supervisor(
    module_swarm,
):
    """Each node's process killed under a training swarm: the stage-0 peer says why, drains what is in flight and
    exits with EXIT_DHT_LOST, leaving no process of its own behind (its node's p2pd goes at its idle timeout, or
    here); then the trainer, likewise."""
    run = "dhtwatch"
    peers = [
        module_swarm.peer(f"{run}-s{k}", k, *SOLO_PEER_FLAGS, run_id=run, wait=False)
        for k in (0, 1)
    ]
    for proc in peers:
        module_swarm.wait_ready(proc)
    trainer = module_swarm.trainer(
        f"{run}-trainer", run_id=run, **TEST_TRAINER, steps=1000, in_flight=2
    )
    daemons = []
    try:
        trainer.wait_for(r"step 1/", timeout_s=120)
        for proc in (peers[0], trainer):
            node, p2pd = dht_process_of(proc.pid)
            daemons.append(p2pd)
            others = [c for c in children(proc.pid) if c != node]
            code, waited = kill_node(proc, node)
            print(f"{proc.name} exited {waited:.1f}s after its DHT process was killed")
            assert code == EXIT_DHT_LOST, (proc.name, code, "".join(proc.lines[-20:]))
            # its averaging processes went with it; torch's shared-memory manager goes when its last client has
            left = [pid for pid in others if not gone_within(pid, 10.0)]
            assert left == [], [(pid, name_of(pid)) for pid in left]
        assert peers[1].alive()  # the other stage's peer serves on
    finally:
        for p2pd in daemons:
            kill_quietly(p2pd)


@pytest.mark.swarm
def test_a_trainer_whose_dht_process_dies_while_it_starts_says_so_and_exits_at_once(module_swarm):
    """A trainer still starting (no peer has published its run yet, so it waits for the run's config) when its
    node's process is killed: it says why and exits with EXIT_DHT_LOST at once, not after --peers-wait-s (before,
    its DHT calls waited forever, bounded by nothing)."""
    run = "dhtwatch-unpublished"
    trainer = module_swarm.trainer(
        "dhtwatch-opening", run_id=run, **TEST_TRAINER, steps=1, peers_wait_s=600
    )
    trainer.wait_for(rf"trainer joined the DHT; reading run '{run}'", timeout_s=120)
    node, p2pd = dht_process_of(trainer.pid)
    try:
        code, waited = kill_node(trainer, node)
        assert code == EXIT_DHT_LOST, (code, "".join(trainer.lines[-20:]))
        assert waited < 120, waited  # well before its 600 s wait for the run would have ended
        said = "".join(trainer.lines[-20:])
        assert "the trainer could not start" in said, said
    finally:
        kill_quietly(p2pd)
