"""A closed batch is stepped when it closes, not at the peer's next periodic step check: the close wakes the check,
the check looks again soon while the batch's all-reduce group forms, and the all-reduce's end wakes it to take the
update (and only the state averagers declare themselves as donors). In lockstep training every batch waits for that
step. Two real averaging replicas in this process, on a real DHT, whose periodic check is set far beyond the test's
wait, so only the wake-ups can step them."""

from __future__ import annotations

import pytest
from livepeers import assert_one_state, averaging_replicas, one_microbatch, until

pytestmark = pytest.mark.integration

# no periodic step check within the test (the group-wait bound below it, as the config requires)
FAR_S = 600.0


async def declared_donors(peer, averager) -> dict[bytes, float]:
    """The replicas that the DHT lists as donors of ``averager``'s state, with their priority (their step)."""
    found = await peer.dht.get(f"{averager.prefix}.all_averagers", latest=True, return_future=True)
    entries = found.value.items() if found is not None and isinstance(found.value, dict) else ()
    return {subkey: item.value for subkey, item in entries if item.value is not None}


def test_a_closed_batch_is_stepped_without_waiting_for_the_periodic_check(loop_thread, boot):
    async def body():
        replicas = await averaging_replicas(
            2,
            "wake",
            boot,
            step_check_s=FAR_S,
            matchmaking_s=0.5,
            group_wait_s=5.0,
            averaging_timeout_s=FAR_S + 1,
        )
        try:
            for seed, peer in enumerate(replicas):
                await one_microbatch(peer, seed)
            assert [p.executor.step for p in replicas] == [0, 0]
            for peer in replicas:
                peer.executor.close_batch(0, replicas=2)
            await until(
                lambda: all(p.executor.step == 1 for p in replicas),
                "both replicas step on the closed batch",
            )
            # read on the compute thread, after the step: the step count goes up before the step has reset its sums
            held = [
                await p._worker.compute(lambda p=p: p.executor.samples_accumulated)
                for p in replicas
            ]
            assert held == [0, 0]
            await assert_one_state(replicas)
            # Newcomers find donors among the state averagers, declared at the step each replica has reached; the
            # gradient averagers, whose state nobody downloads, declare nothing (hivemind re-declared them once
            # per tensor of each all-reduce: most of a peer's DHT traffic)
            opt = replicas[0].executor.optimizer.opt
            want = {p.dht.peer_id.to_bytes(): 1.0 for p in replicas}

            async def state_donors_declared():
                return await declared_donors(replicas[0], opt.state_averager) == want

            await until(
                state_donors_declared, f"the state averagers declared at step 1: {want}", 30
            )
            # (declared once at start, again after each all-reduce and every 30 s, they would be there by now)
            assert await declared_donors(replicas[0], opt.grad_averager) == {}
        finally:
            for peer in replicas:
                await peer.shutdown()

    loop_thread.run(body(), timeout_s=180)
