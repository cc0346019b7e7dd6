"""Learning whether a stage counted a microbatch's gradient: the trainer's half of exactly-once commits.

A peer holds the gradient it computed until the trainer's commit, for ``commit_hold_s`` from before its reply
(see swarm.peer.ledger); the commit rides at the end of the call, and the call ending OK confirms it. When that
confirmation does not come (the stream broke, the status was lost, the peer froze), :func:`commit_outcome`
asks again with the idempotent Commit RPC until the peer answers, and stops asking only once the hold is over
and the peer still cannot be reached, or once nothing listens at its address any more (its process is gone: a
frozen peer's port still accepts connections); each time at the address the peer's newest record names
(:func:`asked_where_it_is`: a relayed peer moves when its relay dies). Its answer is one of:

- APPLIED: the peer counted it (now or before): done;
- DROPPED: the peer says it holds nothing (hold over, call aborted): nothing counted, compute it again;
- UNKNOWN: the peer was unreachable from before the hold ended until after, or its address refuses connections.
  Past the hold, or gone, it can no longer count the gradient, so computing it again elsewhere counts it once,
  unless the peer counted it in the instant before it became unreachable and comes back (a killed peer's
  accumulators are gone with it; a relayed replica whose relay closed its port leaves out what it holds). The
  trainer counts these as unconfirmed commits. Waiting out the hold of a killed peer told nothing more and held
  the microbatch, and with it a lockstep batch, ~13 s (bench/soak.py).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable

import grpc

from swarm.errors import GradientsDropped, SwarmError
from swarm.transport.client import PeerClient, Reply
from swarm.transport.dial import refuses


class Outcome(enum.Enum):
    APPLIED = "applied"
    DROPPED = "dropped"
    UNKNOWN = "unknown"


# Commit RPC: each try's deadline, the pause between tries, and how long past the peer's hold the trainer
# still tries (any answer then is final: the peer has dropped what it did not apply).
COMMIT_TIMEOUT_S = 5.0
RETRY_EVERY_S = 0.5
AFTER_HOLD_S = 3.0
# How long a probe of a silent peer's address waits for a connection (see swarm.transport.dial.refuses)
GONE_PROBE_TIMEOUT_S = 2.0


def asked_where_it_is(
    reply: Reply,
    client_now: Callable[[], PeerClient | None],
    *,
    own_address: Callable[[], bool] = lambda: True,
) -> Reply:
    """``reply`` with its Commit RPC asked at the peer's current address each time: ``client_now()`` is the client
    of the address its newest record announces (None: no record, ask where the call went). A peer behind NAT
    serves at another relay's endpoint once its relay dies, and still holds the gradients there: its address
    refusing connections says nothing of it (``own_address()`` False: it is not probed, see ``Reply.gone``)."""
    first = reply.commit_again
    if first is None or not reply.commit_key:
        return reply

    async def again(timeout_s: float) -> bool:
        client = client_now()
        if client is None:
            return await first(timeout_s)
        return await client.commit(*reply.commit_key, timeout_s)

    async def gone() -> bool:
        if not own_address():
            return False
        client = client_now()
        endpoint = reply.endpoint if client is None else client.endpoint
        return bool(endpoint) and await refuses(endpoint, timeout_s=GONE_PROBE_TIMEOUT_S)

    reply.commit_again = again
    reply.gone = gone
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
        except SwarmError as e:
            if time.monotonic() >= give_up_at:
                return Outcome.UNKNOWN
            if (
                reply.gone is not None
                and getattr(e, "status", None) == grpc.StatusCode.UNAVAILABLE
                and await reply.gone()
            ):
                # Nothing listens at its address: its process is gone (killed mid-commit) and can count nothing
                # more, so the rest of its hold would tell nothing the trainer does not know now. (A frozen peer's
                # port still accepts connections: it is asked on.)
                return Outcome.UNKNOWN
            await asyncio.sleep(RETRY_EVERY_S)
