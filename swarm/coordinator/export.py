"""``swarm export`` gathers the trained model from live peers; ``swarm generate`` samples text from it.

The export file is a plain ``torch.save`` dict: ``{"format": 1, "run": RunConfig.to_dict(), "stages":
[state dict of stage 0, ...], "steps": [optimizer step of each stage]}``, loadable without the swarm.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from swarm.config import RunConfig
from swarm.discovery.dht import DHTConfig, RunDirectory, start_dht
from swarm.errors import StageUnavailable, SwarmError
from swarm.model import FullModel, generate
from swarm.states import PeerState
from swarm.transport.client import PeerClient

logger = logging.getLogger(__name__)

EXPORT_FORMAT = 1


async def gather_stage_states(
    directory: RunDirectory, run: RunConfig, *, timeout_s: float
) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """Parameters of every stage from its most advanced serving peer (the next one if a peer fails)."""
    states, steps = [], []
    for stage, records in enumerate(await directory.all_stages(run.model.num_stages)):
        candidates = sorted(
            (
                r
                for r in records.values()
                if r.state == PeerState.SERVING and r.config_hash == run.fingerprint()
            ),
            key=lambda r: -r.step,
        )
        for record in candidates:
            client = PeerClient(record.endpoint)
            try:
                reply = await client.get_state(directory.run_id, timeout_s=timeout_s)
            except SwarmError as e:
                logger.warning(
                    "stage %d: peer %s failed to send its state (%s); trying another",
                    stage,
                    record.peer_id,
                    e,
                )
                continue
            finally:
                await client.close()
            states.append(
                {
                    k.removeprefix("param/"): v
                    for k, v in reply.tensors.items()
                    if k.startswith("param/")
                }
            )
            steps.append(int(reply.meta.step))
            break
        else:
            raise StageUnavailable(
                f"no live peer of stage {stage} of run '{directory.run_id}' answered; start one "
                f"and export again"
            )
    return states, steps


async def export_run(
    run_id: str, dht_config: DHTConfig, out: str, *, timeout_s: float = 60.0
) -> str:
    dht = await asyncio.to_thread(start_dht, dht_config, client_mode=True)
    try:
        directory = RunDirectory(dht, run_id)
        run = await directory.get_run()
        if run is None:
            raise StageUnavailable(
                f"no run '{run_id}' is published in this DHT (check --run-id and --initial-peers)"
            )
        states, steps = await gather_stage_states(directory, run, timeout_s=timeout_s)
    finally:
        dht.shutdown()
    FullModel.from_stage_states(run.model, states)  # refuse to write something that does not load
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"format": EXPORT_FORMAT, "run": run.to_dict(), "stages": states, "steps": steps}, out
    )
    return f"exported run '{run_id}' (stages at optimizer steps {steps}) to {out}"


def load_exported(path: str) -> tuple[RunConfig, FullModel]:
    """The run config and the assembled model of an export file. ValueError if it is not one."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"cannot read {path} as a swarm export: {e}") from None
    if not isinstance(blob, dict) or blob.get("format") != EXPORT_FORMAT:
        raise ValueError(
            f"{path} is not a swarm export (format {EXPORT_FORMAT}); make one with `swarm export`"
        )
    run = RunConfig.from_dict(blob["run"])
    return run, FullModel.from_stage_states(run.model, blob["stages"])


def generate_text(
    path: str, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int | None, seed: int
) -> str:
    _, model = load_exported(path)
    model.eval()
    out = generate(
        model,
        prompt.encode(),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        generator=torch.Generator().manual_seed(seed),
    )
    return prompt + out.decode("utf-8", errors="replace")
