"""Learning whether a stage counted a microbatch's gradient: the trainer's half of exactly-once commits.

A peer holds the gradient it computed until the trainer's commit, for ``commit_hold_s`` from before its reply
(see swarm.peer.ledger); the commit rides at the end of the call, and the call ending OK confirms it. When that
confirmation does not come (the stream broke, the status was lost, the peer froze), :func:`commit_outcome`
asks again with the idempotent Commit RPC until the peer answers, and stops asking only once the hold is over
and the peer still cannot be reached; each time at the address the peer's newest record names
(:func:`asked_where_it_is`: a relayed peer moves when its relay dies). Its answer is one of:

- APPLIED: the peer counted it (now or before): done;
- DROPPED: the peer says it holds nothing (hold over, call aborted): nothing counted, compute it again;
- UNKNOWN: the peer was unreachable from before the hold ended until after. Past the hold it can no longer
  count the gradient, so computing it again elsewhere counts it once, unless the peer counted it in the
  instant before it became unreachable and comes back (a killed peer's accumulators are gone with it). The
  trainer counts these as unconfirmed commits.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable

from swarm.errors import GradientsDropped, SwarmError
from swarm.transport.client import PeerClient, Reply


class Outcome(enum.Enum):
    APPLIED = "applied"
    DROPPED = "dropped"
    UNKNOWN = "unknown"


# Commit RPC: each try's deadline, the pause between tries, and how long past the peer's hold the trainer
# still tries (any answer then is final: the peer has dropped what it did not apply).
COMMIT_TIMEOUT_S = 5.0
RETRY_EVERY_S = 0.5
AFTER_HOLD_S = 3.0


def asked_where_it_is(reply: Reply, client_now: Callable[[], PeerClient | None]) -> Reply:
    """``reply`` with its Commit RPC asked at the peer's current address each time: ``client_now()`` is the client
    of the address its newest record announces (None: no record, ask where the call went). A peer behind NAT
    serves at another relay's endpoint once its relay dies, and still holds the gradients there."""
    first = reply.commit_again
    if first is None or not reply.commit_key:
        return reply

    async def again(timeout_s: float) -> bool:
        client = client_now()
        if client is None:
            return await first(timeout_s)
        return await client.commit(*reply.commit_key, timeout_s)

    reply.commit_again = again
    return reply


async def commit_outcome(reply: Reply) -> Outcome:
    """Whether the peer that sent ``reply`` (a gradient call's) counted its gradient; see the module."""
    try:
        await asyncio.wait_for(reply.committed, max(reply.hold_until - time.monotonic(), 0.01))
        return Outcome.APPLIED
    except GradientsDropped:
        return Outcome.DROPPED
    except (SwarmError, asyncio.TimeoutError):
        pass  # not confirmed in the call: ask again
    give_up_at = reply.hold_until + AFTER_HOLD_S
    while True:
        try:
            await reply.commit_again(COMMIT_TIMEOUT_S)
            return Outcome.APPLIED
        except GradientsDropped:
            return Outcome.DROPPED
        except SwarmError:
            if time.monotonic() >= give_up_at:
                return Outcome.UNKNOWN
            await asyncio.sleep(RETRY_EVERY_S)
