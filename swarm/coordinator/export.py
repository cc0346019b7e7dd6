"""``swarm export`` gathers the trained model from live peers; ``swarm generate`` samples text from it.

The export is a directory (swarm.coordinator.exportdir): ``model.safetensors``, ``config.json`` (transformers'
for GPT-2 and Llama, which ``AutoModelForCausalLM.from_pretrained`` loads) and ``swarm.json`` (the run).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from swarm.config import RunConfig
from swarm.coordinator.agreement import describe_disagreement, step_groups
from swarm.coordinator.exportdir import load_exported, write_export_dir
from swarm.discovery.dht import DHTConfig, RunDirectory, start_dht
from swarm.discovery.records import StageRecord
from swarm.errors import StageUnavailable, SwarmError
from swarm.model import generate, state_digest
from swarm.model.generate import generate_ids
from swarm.states import PeerState
from swarm.transport.callers import caller_token
from swarm.transport.client import PeerClient
from swarm.transport.security import PeerAddress

logger = logging.getLogger(__name__)


class ReplicasDisagree(SwarmError):
    """Serving replicas of a stage at the same optimizer step announce different parameters: which one is
    "the" model is a choice the user makes (``--allow-disagreement`` takes the most advanced one)."""

    retry_elsewhere = False


async def gather_stage_states(
    directory: RunDirectory,
    run: RunConfig,
    *,
    timeout_s: float,
    allow_disagreement: bool = False,
) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """Parameters of every stage from its most advanced serving peer (the next one if a peer fails).

    Raises :class:`ReplicasDisagree` naming the peers when the serving replicas at a stage's highest step
    announce different digests (unless ``allow_disagreement``), and :class:`StageUnavailable` when no peer
    of a stage sent a state that hashes to what it announced.
    """
    states, steps = [], []
    for stage, records in enumerate(await directory.all_stages(run.model.num_stages)):
        candidates = sorted(
            (
                r
                for r in records.values()
                if r.state == PeerState.SERVING and r.config_hash == run.fingerprint()
            ),
            key=lambda r: (-r.step, r.peer_id),  # ties: the same peer on every read
        )
        _check_agreement(stage, candidates, run, allow_disagreement=allow_disagreement)
        for record in candidates:
            params, step = await _download(directory, stage, record, timeout_s=timeout_s)
            if params is not None:
                states.append(params)
                steps.append(step)
                break
        else:
            raise StageUnavailable(
                f"no live peer of stage {stage} of run '{directory.run_id}' sent a usable state (see the "
                f"warnings above); start one and export again"
            )
    return states, steps


def _check_agreement(
    stage: int, candidates: list[StageRecord], run: RunConfig, *, allow_disagreement: bool
) -> None:
    if not candidates:
        return
    top = candidates[0].step
    groups = step_groups(candidates, config_hash=run.fingerprint())
    if len(groups.get(top, {})) <= 1:
        return
    where = f"stage {stage}'s serving replicas disagree {describe_disagreement(top, groups[top])}"
    if not allow_disagreement:
        raise ReplicasDisagree(
            f"{where}; they were trained apart (no --average, or a failed all-reduce). Export with "
            f"--allow-disagreement to take peer {candidates[0].peer_id}'s parameters anyway"
        )
    logger.warning("%s; exporting peer %s's, as asked", where, candidates[0].peer_id)


async def _download(
    directory: RunDirectory, stage: int, record: StageRecord, *, timeout_s: float
) -> tuple[dict[str, torch.Tensor] | None, int]:
    """The parameters and step ``record``'s peer sends, or (None, 0) if it failed or sent parameters that do not
    hash to the digest it announced for that step. A peer that stepped since its record was read cannot be
    checked against it (its new digest is not announced yet): its state is taken, with a warning, since a
    training swarm steps every few seconds and a re-read would race the same way."""
    client = PeerClient(PeerAddress.of(record), token=caller_token(directory.identity))
    try:
        reply = await client.get_state(directory.run_id, timeout_s=timeout_s)
    except SwarmError as e:
        logger.warning(
            "stage %d: peer %s failed to send its state (%s); trying another",
            stage,
            record.peer_id,
            e,
        )
        return None, 0
    finally:
        await client.close()
    params = {
        k.removeprefix("param/"): v for k, v in reply.tensors.items() if k.startswith("param/")
    }
    step = int(reply.meta.step)
    if not record.param_digest:
        logger.warning(
            "stage %d: peer %s announces no parameter digest (an older version, or not hashed since its "
            "last step): its state is not checked",
            stage,
            record.peer_id,
        )
    elif step != record.step:
        logger.warning(
            "stage %d: peer %s stepped from %d to %d since its record was read: its state is not checked "
            "against its digest",
            stage,
            record.peer_id,
            record.step,
            step,
        )
    elif (got := state_digest(params)) != record.param_digest:
        logger.warning(
            "stage %d: peer %s announced digest %s at step %d but sent parameters hashing to %s; trying another",
            stage,
            record.peer_id,
            record.param_digest,
            step,
            got,
        )
        return None, 0
    return params, step


async def export_run(
    run_id: str,
    dht_config: DHTConfig,
    out: str,
    *,
    timeout_s: float = 60.0,
    allow_disagreement: bool = False,
    tokenizer: str | None = None,
) -> str:
    if tokenizer is not None:  # refuse a wrong tokenizer before downloading anything
        from swarm.data.tokenizer import HFTokenizer

        HFTokenizer.load(tokenizer)
    dht = await asyncio.to_thread(start_dht, dht_config, client_mode=True)
    try:
        directory = RunDirectory(dht, run_id, run_owner=dht_config.run_owner)
        run = await directory.get_run()
        if run is None:
            raise StageUnavailable(
                f"no run '{run_id}' is published in this DHT (check --run-id and --initial-peers)"
            )
        states, steps = await gather_stage_states(
            directory, run, timeout_s=timeout_s, allow_disagreement=allow_disagreement
        )
    finally:
        dht.shutdown()
    write_export_dir(out, run, states, steps, tokenizer=tokenizer)
    with_tokenizer = "" if tokenizer is None else f", with the tokenizer of {tokenizer}"
    return f"exported run '{run_id}' (stages at optimizer steps {steps}) to {out}{with_tokenizer}"


def generate_text(
    path: str,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    device: str = "cpu",
) -> str:
    """The prompt and up to ``max_new_tokens`` sampled tokens after it (bytes, or the export's tokenizer's when it
    carries one), from the model exported at ``path``, run on ``device`` (a ``--device`` name: auto, cpu,
    cuda[:N], mps); sampling draws on the CPU, so a seed gives the same text on any device up to the device's
    arithmetic."""
    from pathlib import Path

    from swarm.data.tokenizer import TOKENIZER_JSON, HFTokenizer, check_vocab
    from swarm.model.device import resolve_device

    _, model = load_exported(path)
    model.to(resolve_device(device)).eval()
    if (Path(path) / TOKENIZER_JSON).is_file():  # the export carries the run's tokenizer
        tok = HFTokenizer.load(path)
        check_vocab(tok, model.config.vocab_size)
        ids = tok.encode(prompt)
        if not ids:
            raise ValueError("the prompt encodes to no tokens; give a longer --prompt")
        new = generate_ids(
            model,
            ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            generator=torch.Generator().manual_seed(seed),
        )
        return tok.decode(ids + new)
    out = generate(
        model,
        prompt.encode(),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        generator=torch.Generator().manual_seed(seed),
    )
    return prompt + out.decode("utf-8", errors="replace")
