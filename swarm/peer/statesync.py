"""Download a stage's parameters from the peers that serve it (a newcomer or a peer moving in)."""

from __future__ import annotations

import logging

import torch

from swarm.discovery.dht import RunDirectory
from swarm.discovery.records import StageRecord
from swarm.errors import SwarmError
from swarm.states import PeerState
from swarm.transport.callers import caller_token
from swarm.transport.client import PeerClient
from swarm.transport.security import PeerAddress

logger = logging.getLogger(__name__)


async def serving_peers(
    directory: RunDirectory, stage: int, *, exclude: str = ""
) -> list[StageRecord]:
    """The serving peers of ``stage`` but ``exclude``, most advanced (highest optimizer step) first."""
    records = await directory.stage_records(stage)
    return sorted(
        (r for r in records.values() if r.state == PeerState.SERVING and r.peer_id != exclude),
        key=lambda r: -r.step,
    )


async def fetch_stage_state(
    directory: RunDirectory, stage: int, *, exclude: str = "", timeout_s: float
) -> dict[str, torch.Tensor] | None:
    """Parameters of ``stage`` from its most advanced serving peer (highest optimizer step), trying the
    next one if a peer fails. None when no peer serves the stage."""
    for record in await serving_peers(directory, stage, exclude=exclude):
        if not record.callable:  # behind NAT without a relay: no connection to it can be opened
            continue
        client = PeerClient(PeerAddress.of(record), token=caller_token(directory.identity))
        try:
            reply = await client.get_state(directory.run_id, timeout_s=timeout_s)
            return {
                name.removeprefix("param/"): t
                for name, t in reply.tensors.items()
                if name.startswith("param/")
            }
        except SwarmError as e:
            logger.warning(
                "could not load stage %d state from peer %s: %s", stage, record.peer_id, e
            )
        finally:
            await client.close()
    return None
