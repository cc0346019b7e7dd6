"""`swarm plot`: the training curves of trainers' metrics files, as a picture; bad files get one clear line."""

from __future__ import annotations

import json

import pytest

from swarm import cli


def _metrics(path, steps: int, *, start_loss: float) -> None:
    lines = []
    for step in range(1, steps + 1):
        lines.append(
            {"step": step, "loss": start_loss / step, "tokens_per_s": 1000.0 + step, "time_s": step}
        )
        if step % 5 == 0:
            lines.append({"step": step, "val_loss": start_loss / step + 0.1, "time_s": step + 0.5})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_plot_draws_the_curves_of_several_runs(tmp_path, capsys):
    a, b = tmp_path / "lockstep.jsonl", tmp_path / "pipelined.jsonl"
    _metrics(a, 20, start_loss=5.0)
    _metrics(b, 12, start_loss=6.0)
    out = tmp_path / "pictures" / "curves.png"
    assert cli.main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    picture = out.read_bytes()
    assert (
        picture.startswith(b"\x89PNG\r\n\x1a\n") and len(picture) > 20_000
    )  # two panels of curves

    from swarm.coordinator.plot import read_metrics

    curves = read_metrics(a)
    assert curves.steps == list(range(1, 21)) and curves.val_steps == [5, 10, 15, 20]
    assert curves.losses[0] == 5.0 and curves.val_losses[0] == pytest.approx(1.1)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"step": 1, "val_loss": 3.0}\n', "holds no training step"),
        (
            '{"step": 1, "loss": 3.0}\n',
            ":1 is not a line of `swarm train --metrics-path` (KeyError",
        ),
        ("not json\n", ":1 is not a line of `swarm train --metrics-path` (JSONDecodeError"),
    ],
)
def test_a_file_that_is_not_a_metrics_file_exits_2_with_one_line(tmp_path, capsys, text, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    assert cli.main(["plot", str(bad), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and err.startswith(f"swarm plot: error: {bad}") and message in err
    ), err
    assert not (tmp_path / "x.png").exists()


def test_a_missing_file_exits_2(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "nowhere.jsonl")]) == 2
    assert "cannot read the metrics file" in capsys.readouterr().err
