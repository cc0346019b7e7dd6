"""The trainer's summary line: one printer (TrainSummary.describe), one parser (TrainSummary.parse), and the
parser reads back every printed field, so the tests and benchmarks that read a trainer's log see what it said."""

from __future__ import annotations

import dataclasses
import math

import pytest

from swarm.trainer.trainer import TrainSummary

LINE = (
    "trained 40 steps (640 samples, 79/80 microbatches completed) in 61s | initial loss 5.612 -> final loss "
    "3.070 | validation loss 3.125 | 12,345 tokens/s | 3 calls retried elsewhere, 1 unconfirmed commits"
)


def _summary(**fields) -> TrainSummary:
    """LINE's summary with ``fields`` changed (values at the precision describe() prints)."""
    return dataclasses.replace(TrainSummary.parse(LINE), **fields)


def test_parse_reads_each_field_from_its_place():
    s = TrainSummary.parse(LINE)
    assert (s.steps, s.samples, s.microbatches, s.microbatches_started) == (40, 640, 79, 80)
    assert (s.seconds, s.initial_loss, s.final_loss, s.val_loss) == (61.0, 5.612, 3.07, 3.125)
    assert (s.tokens_per_s, s.failed_calls, s.unconfirmed_commits) == (12345.0, 3, 1)
    assert s.losses == [] and s.describe() == LINE


@pytest.mark.parametrize(
    "fields",
    [
        {},
        dict(failed_calls=0, unconfirmed_commits=0, tokens_per_s=7.0, seconds=0.0),
        dict(steps=100000, samples=3_200_000, tokens_per_s=1_234_567.0, seconds=86400.0),
    ],
)
def test_parse_reads_back_every_field_describe_prints(fields):
    summary = _summary(**fields)
    assert TrainSummary.parse(summary.describe()) == summary


def test_parse_finds_the_line_in_a_log_and_takes_the_last():
    first, last = _summary(steps=1), _summary(steps=2, val_loss=2.5)
    log = f"step 1/2 | loss 5.6\n{first.describe()}\nnoise\n{last.describe()}\nbye\n"
    assert TrainSummary.parse(log) == last


def test_parse_rounds_as_printed():
    exact = _summary(initial_loss=5.61234, tokens_per_s=999.6, seconds=2.4, losses=[5.6, 5.5])
    parsed = TrainSummary.parse(exact.describe())
    assert parsed == dataclasses.replace(
        exact, initial_loss=5.612, tokens_per_s=1000.0, seconds=2.0, losses=[]
    )


def test_parse_reads_nan_losses_of_a_run_without_steps():
    parsed = TrainSummary.parse(
        _summary(steps=0, initial_loss=math.nan, final_loss=math.nan).describe()
    )
    assert parsed.steps == 0 and math.isnan(parsed.initial_loss) and math.isnan(parsed.final_loss)


def test_parse_refuses_text_without_a_summary():
    with pytest.raises(ValueError, match="no trainer summary line"):
        TrainSummary.parse("step 3/40 | loss 4.1 | 900 tokens/s\n")


def test_progress_lines_are_plain_in_logs_and_carry_a_bar_and_the_time_left_on_a_terminal():
    from swarm.trainer.trainer import progress_line

    nan = float("nan")
    # In a log or a pipe: one plain line, which the demo and the tests read.
    assert (
        progress_line(12, 100, 3.1, nan, 14000.4, 60.0) == "step 12/100 | loss 3.100 | 14,000 tok/s"
    )
    assert progress_line(7, 0, 2.5, 2.75, 10.0, 5.0, bar=True) == (
        "step 7 | loss 2.500 | val 2.750 | 10 tok/s"  # no total, no bar: training until interrupted
    )
    # On a terminal: 12 of 100 steps in 60 s leaves 88 steps at 5 s each.
    assert progress_line(12, 100, 3.1, 3.2, 14000.0, 60.0, bar=True, width=10) == (
        "step 12/100 [#.........] | loss 3.100 | val 3.200 | 14,000 tok/s | 7m20s left"
    )
    assert progress_line(50, 100, 3.1, nan, 1.0, 3 * 3600.0, bar=True, width=4).endswith(
        "[##..] | loss 3.100 | 1 tok/s | 3h00m left"
    )
    assert progress_line(100, 100, 3.1, nan, 1.0, 9.0, bar=True, width=4).endswith(
        "[####] | loss 3.100 | 1 tok/s | 0s left"
    )
