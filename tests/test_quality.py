"""Training quality with compressed activations and gradients: the short version of bench/quality.py.

A tiny model (d_model 32) trains on a real loopback swarm (bootstrap, 2 peer processes, trainer, all through
the CLI) for a few hundred samples per codec, from the same init and data order. With one microbatch in flight
the runs differ only by the codec, so each validation-loss gap is the codec's. The runs share one bootstrap
node and one reference run (codec none).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench.quality import QualityConfig, QualityResult, Scheme, relative_gap, run_codec
from swarm.config import RunConfig
from swarm.coordinator.launcher import ProcessGroup
from swarm.coordinator.localswarm import Where, publish_run_at, start_bootstrap
from swarm.model import ModelConfig

pytestmark = pytest.mark.swarm

MODEL = ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=32, num_stages=2, seed=0)
STEPS = 25  # x 16 samples = 400 samples per run
# |val(int8) - val(none)| / val(none). Measured 0.0001% here (3.82425 vs 3.82424; one microbatch in flight
# makes the runs deterministic, so it is the same each run); the codec bench measures 0.02% on the larger run.
# What the bound must catch: the same int8 codec with 4-bit levels (_QMAX 7 instead of 127) ends 0.098% apart
# (3.82799). 0.01% is 100x the measured gap and 10x below that. (The previous 2% passed the 4-bit codec too.)
INT8_GAP = 0.0001
# The low-bit codecs on the same runs. Measured (deterministic, as above): int4 0.0081% (3.82394), int2 0.22%
# (3.83270), int2sr 0.99% (3.86228), int2 activations with int8 gradients 0.21% (3.83226). Bounds, each about
# twice to six times its gap and below the next coarser codec's: int4 0.05% (an int4 that lost two of its bits
# fails), int2 0.5% (one that rounds like int2sr fails), int2sr 2%; all far below what a codec that lost the
# activations does (a run whose activations arrive as zeros cannot learn past the unigram loss, > 20% worse).
LOW_BIT_GAPS = {
    "int4": 0.0005,
    "int2": 0.005,
    "int2sr": 0.02,
}
# The subspace cut (swarm.model.subspace, --subspace-dim 8 of d_model 32) with int4 on the wire: another model than
# none's (the blocks of stage 0 write into 8 of 32 directions), so its gap is the scheme's, not only the codec's.
# Measured 0.19% (3.83132 against 3.82425; deterministic as above); the bound is about 5x that.
SUBSPACE_GAP = 0.01
# The bottleneck with the token ids beside it and delta coding (--bottleneck-dim 4 --bottleneck-tokens, int4 on the
# wire): 4 int4 values and the id per token, 3.25 bytes against 128 float32 bytes (39x). Another model than
# none's, so its gap is the scheme's. Measured 0.69% (3.85058 against 3.82425; deterministic as above); the bound
# is about 3x that, far below a run whose activations and ids were lost (> 20%, as above).
TOKENS_SCHEME = "int4+bn4+tok"
TOKENS_GAP = 0.02
CODECS = ("none", "int8", *LOW_BIT_GAPS, "int2/int8")  # the last: int2 activations, int8 gradients


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, QualityResult]:
    return _train(tmp_path_factory.mktemp("quality"), CODECS)


@pytest.fixture(scope="module")
def subspace_runs(tmp_path_factory, runs) -> dict[str, QualityResult]:
    # none's run is the same here (same model, seed and samples; deterministic): it is not trained again
    sub = _train(tmp_path_factory.mktemp("quality-subspace"), ("int4+sub8",), none=runs["none"])
    return {"none": runs["none"], **sub}


@pytest.fixture(scope="module")
def bottleneck_runs(tmp_path_factory, runs) -> dict[str, QualityResult]:
    # none's run is shared as above
    cut = _train(tmp_path_factory.mktemp("quality-bottleneck"), (TOKENS_SCHEME,), none=runs["none"])
    return {"none": runs["none"], **cut}


def _train(
    tmp_path, codecs: tuple[str, ...], *, none: QualityResult | None = None
) -> dict[str, QualityResult]:
    """One run per scheme, sharing one bootstrap node; gaps are printed against ``none`` (else the run of
    "none", which then comes first in ``codecs``)."""
    cfg = QualityConfig(
        codecs=codecs
        if codecs[0] == "none"
        else ("none", *codecs),  # the config names its reference
        preset=None,
        steps=STEPS,
        microbatch_size=8,
        in_flight=1,
        target_batch_size=16,
        eval_every_steps=0,
        eval_batches=4,
        max_data_bytes=2_000_000,
        run_timeout_s=180,
    )
    results = {}
    with ProcessGroup(tmp_path) as group:
        addr_file = tmp_path / "bootstrap.addr"
        start_bootstrap(group, addr_file)
        for codec in codecs:
            run_id = f"q-{codec.replace('/', '-')}"
            scheme = Scheme.parse(codec)
            # From a child process: a DHT node forked from this test process (which has run gRPC servers and
            # torch threads in earlier tests) once spun at 100% CPU instead of starting: it freed inherited
            # grpc.aio objects (fixed in swarm/forking.py; publishing from a child is kept).
            publish_run_at(
                Where(),
                addr_file,
                run_id,
                RunConfig(
                    model=dataclasses.replace(
                        MODEL,
                        subspace_dim=scheme.subspace_dim,
                        bottleneck_dim=scheme.bottleneck_dim,
                        bottleneck_init=scheme.bottleneck_init,
                        bottleneck_tokens=scheme.bottleneck_tokens,
                    ),
                    codec=scheme.codec,
                    grad_codec=scheme.grad_codec,
                    target_batch_size=16,
                    lr=3e-3,
                    warmup_steps=5,
                    total_steps=STEPS,
                ),
            )
            results[codec] = run_codec(
                group, cfg, codec=codec, run_id=run_id, addr_file=addr_file, workdir=tmp_path
            )
    print(
        "validation loss: "
        + ", ".join(
            f"{codec} {r.final_val:.5f} ({relative_gap(r, none or results['none']):.4%})"
            for codec, r in results.items()
        )
    )
    return results


def test_int8_validation_loss_close_to_none(runs):
    none, int8 = runs["none"], runs["int8"]
    # Both runs learned (otherwise equal losses would prove nothing): well below ln(256) of an untrained model.
    assert none.final_val < 0.8 * math.log(256), none.val_curve
    # int8 really went over the wire: quantisation noise makes the runs differ, if only slightly.
    assert int8.final_val != none.final_val
    gap = relative_gap(int8, none)
    assert gap <= INT8_GAP, (none.final_val, int8.final_val)


@pytest.mark.parametrize("codec", sorted(LOW_BIT_GAPS))
def test_a_swarm_trains_through_the_cli_with_4_and_2_bit_activations_and_gradients(runs, codec):
    none, low = runs["none"], runs[codec]
    assert low.final_val < 0.8 * math.log(256), low.val_curve
    # the codec was on the wire: a coarser one moves the result further than int8's noise
    assert relative_gap(low, none) > relative_gap(runs["int8"], none)
    assert relative_gap(low, none) <= LOW_BIT_GAPS[codec], (none.final_val, low.final_val)


def test_gradients_cross_the_cut_in_their_own_codec(runs):
    """int2 activations with int8 gradients (--grad-codec int8): the same forward as int2, another backward."""
    mixed, int2 = runs["int2/int8"], runs["int2"]
    assert mixed.final_val != int2.final_val  # the gradient codec took effect
    assert relative_gap(mixed, runs["none"]) <= LOW_BIT_GAPS["int2"]


def test_a_swarm_trains_through_the_cli_with_the_subspace_cut(subspace_runs):
    """The subspace cut with int4: 8 values and the token id cross the cut per token, and the run learns."""
    none, sub = subspace_runs["none"], subspace_runs["int4+sub8"]
    assert sub.final_val < 0.8 * math.log(256), sub.val_curve
    assert relative_gap(sub, none) <= SUBSPACE_GAP, (none.final_val, sub.final_val)


def test_a_swarm_trains_through_the_cli_with_the_token_ids_beside_the_bottleneck(bottleneck_runs):
    """The stage after the cut embeds the ids it received; the stage before sends its blocks' writes through
    the 4-wide bottleneck in int4; the run learns."""
    none, cut = bottleneck_runs["none"], bottleneck_runs[TOKENS_SCHEME]
    assert cut.final_val < 0.8 * math.log(256), cut.val_curve
    assert cut.final_val != none.final_val  # another model and codec: the runs differ
    assert relative_gap(cut, none) <= TOKENS_GAP, (none.final_val, cut.final_val)
