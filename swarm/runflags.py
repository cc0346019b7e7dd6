"""The flags that describe a new run (``--preset``, ``--model-config``, the cut, the bottleneck or subspace, and
RunConfig's own fields), shared by ``swarm peer`` and ``swarm dht``, and the RunConfig they give."""

from __future__ import annotations

import argparse
import dataclasses

from swarm.argconfig import add_config_args, config_from_args


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    from swarm.config import RunConfig
    from swarm.model import ALL_PRESETS

    group = parser.add_argument_group(RunConfig.FLAG_TITLE)  # add_config_args fills the same group
    group.add_argument(
        "--preset",
        choices=sorted(ALL_PRESETS),
        default=None,
        help="start a new run with this model preset if the DHT has none for --run-id "
        "(the run flags below apply only then); gpt2-* and llama-* are Hugging Face models",
    )
    group.add_argument(
        "--model-config",
        default=None,
        metavar="PATH",
        help="instead of --preset: a new run of the GPT-2 or Llama model a transformers config.json (or "
        "the directory holding it) describes, initialised from the seed",
    )
    group.add_argument(
        "--num-stages",
        type=int,
        default=None,
        help="with a new run: cut the model into this many stages (default: the preset's; 2)",
    )
    group.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="with a new run: the training context in tokens (default: the preset's; 128 for a config)",
    )
    group.add_argument(
        "--bottleneck-dim",
        type=int,
        default=None,
        help="with --preset: compress activations at stage cuts to this width (learned "
        "down/up projections, SWARM's bottleneck); default off",
    )
    group.add_argument(
        "--bottleneck-init",
        choices=("random", "orthogonal", "scaled", "pca", "pca-frozen"),
        default="random",
        help="with --bottleneck-dim: start the down/up pair as independent random matrices, or as "
        "Q^T and Q for one orthonormal Q (a projection onto a subspace; measured worse than random on "
        "tiny, see docs/compression.md), or random's pair stored at GPT-2's 0.02 scale times a fixed gain, so "
        "AdamW moves it as fast relative to its size as the other weights; pca starts it as U^T and U, U the "
        "top principal directions of the cut's stream at init (every peer computes them from the seed), and "
        "pca-frozen keeps that pair fixed (peers of older versions refuse pca and pca-frozen)",
    )
    group.add_argument(
        "--bottleneck-tokens",
        action="store_true",
        help="with --bottleneck-dim: send the token ids (1 byte per token) beside the bottleneck, and let the "
        "stage after each cut embed them itself, so the bottleneck carries only context (peers of older "
        "versions refuse the run; see docs/compression.md)",
    )
    group.add_argument(
        "--subspace-dim",
        type=int,
        default=None,
        help="with --preset: the lossless subspace cut (protocol models): blocks before the last stage "
        "write into one fixed subspace of this width, so activations cross cuts as that many values per token "
        "plus the token id (peers of older versions refuse the run); default off",
    )
    add_config_args(parser, RunConfig, skip={"model"})


def run_config_from_args(args: argparse.Namespace, pretrained: str | None = None):
    """The RunConfig to publish, or None to join the run found in the DHT. A new run comes from --preset,
    --model-config, or a Hugging Face checkpoint given as --pretrained (the peer's weights directory)."""
    from swarm.config import RunConfig
    from swarm.model import ALL_PRESETS, HFModelConfig

    chosen = [
        flag
        for flag, value in (("--preset", args.preset), ("--model-config", args.model_config))
        if value
    ]
    if len(chosen) > 1:
        raise ValueError(f"give one of {' and '.join(chosen)}: both describe the model")
    if not chosen and pretrained is None:
        return None
    cut = {
        k: v
        for k, v in (("num_stages", args.num_stages), ("seq_len", args.seq_len))
        if v is not None
    }
    if args.preset is not None and pretrained is not None:
        raise ValueError(
            f"--preset {args.preset} and --pretrained both describe the model: drop --preset (the checkpoint's "
            "config.json says what the model is)"
        )
    if args.preset is not None:
        model = dataclasses.replace(ALL_PRESETS[args.preset], **cut)
    elif pretrained is not None:
        if args.model_config is not None:
            raise ValueError("drop --model-config: --pretrained's config.json describes the model")
        model = HFModelConfig.from_pretrained_dir(pretrained, **cut)
    else:
        model = HFModelConfig.from_config_json(args.model_config, **cut)
    if args.bottleneck_dim is not None:
        if isinstance(model, HFModelConfig):
            raise ValueError(
                "--bottleneck-dim is for the built-in GPT presets, not Hugging Face models"
            )
        model = dataclasses.replace(
            model,
            bottleneck_dim=args.bottleneck_dim,
            bottleneck_init=args.bottleneck_init,
            bottleneck_tokens=args.bottleneck_tokens,
        )
    elif args.bottleneck_tokens:
        raise ValueError(
            "--bottleneck-tokens sends the token ids beside a bottleneck: give --bottleneck-dim too"
        )
    if args.subspace_dim is not None:
        if isinstance(model, HFModelConfig):
            raise ValueError(
                "--subspace-dim is for the built-in GPT presets, not Hugging Face models"
            )
        model = dataclasses.replace(model, subspace_dim=args.subspace_dim)
    return config_from_args(RunConfig, args, model=model)
