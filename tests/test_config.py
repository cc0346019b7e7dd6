"""Configs, records and flags: bad values fail early with a sentence that has the numbers in it."""

from __future__ import annotations

import logging
import math
import re
import subprocess
import sys

import pytest
from conftest import record_wire

from swarm.compression import UnknownCodecError
from swarm.config import RunConfig
from swarm.discovery.records import RecordError, StageRecord
from swarm.model import MODEL_PRESETS, ModelConfig
from swarm.states import PeerState

pytestmark = pytest.mark.integration


def test_run_config_validation_names_the_numbers():
    with pytest.raises(
        ValueError, match="codec 'gzip' is unknown; choose one of none, fp16, bf16, int8"
    ):
        RunConfig(codec="gzip")
    with pytest.raises(ValueError, match="target_batch_size must be >= 1, got 0"):
        RunConfig(target_batch_size=0)
    with pytest.raises(ValueError, match="lr must be a positive finite number, got nan"):
        RunConfig(lr=math.nan)
    with pytest.raises(ValueError, match=r"warmup_steps \(-1\)"):
        RunConfig(warmup_steps=-1)


def test_run_config_round_trips_and_reads_remote_dicts_carefully():
    run = RunConfig(model=MODEL_PRESETS["w1"], codec="int8", target_batch_size=64, lr=3e-4)
    assert RunConfig.from_dict(run.to_dict()) == run
    newer = {**run.to_dict(), "field_from_the_future": 1}
    assert RunConfig.from_dict(newer) == run  # unknown fields are ignored
    with pytest.raises(ValueError, match="'target_batch_size' must be int, got '64'"):
        RunConfig.from_dict({**run.to_dict(), "target_batch_size": "64"})
    with pytest.raises(ValueError, match="run config must be a dict, got list"):
        RunConfig.from_dict([1, 2])
    # required although it has a default
    with pytest.raises(ValueError, match="run config lacks field 'model'"):
        RunConfig.from_dict({k: v for k, v in run.to_dict().items() if k != "model"})
    assert run.fingerprint() == RunConfig.from_dict(run.to_dict()).fingerprint()
    assert run.fingerprint() != RunConfig(model=MODEL_PRESETS["w1"]).fingerprint()


def test_peer_and_trainer_configs_reject_bad_values():
    from swarm.peer.config import PeerConfig
    from swarm.trainer.trainer import TrainerConfig

    with pytest.raises(ValueError, match="stage must be >= 0, got -1"):
        PeerConfig(stage=-1)
    with pytest.raises(ValueError, match="heartbeat_s=5.0, ttl_s=5.0"):
        PeerConfig(heartbeat_s=5.0, ttl_s=5.0)
    with pytest.raises(ValueError, match="slowdown is a factor >= 1"):
        PeerConfig(slowdown=0.5)
    with pytest.raises(ValueError, match=r"microbatch_size \(0\)"):
        TrainerConfig(microbatch_size=0)


def test_stage_records_are_validated_and_forward_compatible():
    record = StageRecord.from_wire(record_wire())
    assert record.throughput == 10.0 and record.state is PeerState.SERVING
    # what the DHT stores: the state as its plain string, back to the same record
    wire = record.to_wire()
    assert (
        type(wire["state"]) is str
        and wire["state"] == "serving"
        and StageRecord.from_wire(wire) == record
    )
    assert StageRecord.from_wire(record_wire(extra="from a newer peer")).step == 3
    assert StageRecord.from_wire(record_wire(throughput=7)).throughput == 7.0  # ints are fine
    for bad, needle in [
        (record_wire(throughput=math.nan), "'throughput' must be a finite float, got nan"),
        (record_wire(throughput=-1.0), "out-of-range"),
        (record_wire(state="dancing"), "state"),
        (record_wire(step="3"), "'step' must be int"),
        (record_wire(endpoint="nowhere"), "endpoint"),
        ({k: v for k, v in record_wire().items() if k != "endpoint"}, "lacks field 'endpoint'"),
        ("not a dict", "must be a dict"),
    ]:
        with pytest.raises(RecordError, match=needle):
            StageRecord.from_wire(bad)


def test_trainer_records_are_validated_and_round_trip():
    from swarm.discovery.records import TrainerRecord

    record = TrainerRecord(trainer_id="t1", step=4, loss=2.5, tokens_per_s=100.0, microbatches=8)
    assert TrainerRecord.from_wire(record.to_wire()) == record
    assert (
        TrainerRecord.from_wire({"trainer_id": "t2", "step": 0}).loss is None
    )  # before its first step
    for bad, needle in [
        ({"trainer_id": "t", "step": 1, "loss": math.inf}, "'loss' must be a finite float"),
        ({"trainer_id": "t", "step": -1}, "out-of-range"),
        ({"trainer_id": "t", "step": 1, "tokens_per_s": -5.0}, "out-of-range"),
        ({"step": 1}, "trainer_id"),
    ]:
        with pytest.raises(RecordError, match=needle):
            TrainerRecord.from_wire(bad)


def test_model_presets_are_the_standard_workloads():
    assert MODEL_PRESETS["w1"] == ModelConfig(
        d_model=256, n_heads=4, n_layers=4, seq_len=128, num_stages=2
    )
    assert MODEL_PRESETS["w2"].d_model == 512 and MODEL_PRESETS["w2"].seq_len == 256
    assert MODEL_PRESETS["w3"].num_stages == 3 and len(MODEL_PRESETS["w3"].stage_layers(0)) == 4


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["peer", "--stage", "-2"], "stage must be >= 0, got -2"),
        (["train", "--microbatch-size", "0"], "microbatch_size (0)"),
        (["peer", "--preset", "huge"], "invalid choice: 'huge'"),
        (["peer", "--codec", "int3"], "argument --codec: invalid choice: 'int3' (choose from"),
        (["demo", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["train", "--steps", "many"], "invalid int value: 'many'"),
        (["peer", "--announce-host", "10.0.0.1"], "--announce-host needs an explicit --dht-port"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(args, needle):
    result = _cli(*args)
    assert result.returncode == 2, result
    assert needle in result.stderr, result.stderr


def test_swarm_help_and_version_import_neither_torch_nor_hivemind():
    # A command's flags are built only when it is named, from config modules that import neither: `swarm
    # --help` and `swarm COMMAND --help` answer at once.
    code = (
        "import sys, swarm.cli\n"
        "for argv in (['--help'], ['--version'], *([c, '--help'] for c in swarm.cli.COMMANDS)):\n"
        "    try:\n"
        "        swarm.cli.main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'hivemind'}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "[]", lines[-1]
    assert any(re.fullmatch(r"swarm \d+\.\d+\.\d+", line) for line in lines), done.stdout
    for command in ("peer", "train", "status", "export", "demo", "simulate"):
        assert f"usage: swarm {command}" in done.stdout


def test_peer_help_shows_the_essentials_first_and_the_internals_under_advanced():
    titles = [
        line[:-1]
        for line in _cli("peer", "--help").stdout.splitlines()
        if line.endswith(":") and not line.startswith(" ")  # a group title, not a wrapped help line
    ]
    advanced = [t for t in titles if t.startswith("advanced")]
    assert titles[-len(advanced) :] == advanced, titles  # every advanced group after every other
    assert {"advanced: caches and commits"} < set(advanced)
    assert any("fault injection" in t for t in advanced)
    assert titles.index("peer") < titles.index(advanced[0])


def test_help_text_comes_from_the_config_comments():
    out = " ".join(_cli("peer", "--help").stdout.split())  # argparse wraps lines
    assert "announcement lifetime: a silent peer disappears from routing after this" in out
    assert "--data" in _cli("train", "--help").stdout


def test_a_trainer_with_no_run_to_join_exits_1_with_one_line_saying_what_to_do():
    result = _cli("train", "--run-id", "nobody-here", "--peers-wait-s", "0.5")
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith("swarm train: error: no run 'nobody-here' was published"), (
        result.stderr
    )
    assert "swarm peer --run-id nobody-here --stage 0 --preset" in lines[-1]


def test_retries_running_out_reach_the_user_as_one_line_and_exit_1(monkeypatch, capsys):
    from swarm import cli
    from swarm.errors import TransportError
    from swarm.routing import RetryBudget

    def train(args):  # what a trainer's pipeline raises when every attempt at stage 1 failed
        budget = RetryBudget(1, max_attempts=2)
        budget.record_failure("p1", TransportError("peer 10.0.0.1:7000: connection refused"))
        budget.record_failure("p2", TransportError("peer 10.0.0.2:7000: deadline\nexceeded"))

    monkeypatch.setattr(cli, "_train", train)
    assert cli.main(["train"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        "swarm train: error: stage 1 request failed after 2 attempt(s) (last error: "
        "TransportError: peer 10.0.0.2:7000: deadline exceeded)"
    )
    assert "add peers, or raise RoutingConfig.max_attempts (`swarm train --max-attempts`)" in err


@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    """The schema's warned-once memory, empty for this test; its warnings captured."""
    from swarm import schema

    monkeypatch.setattr(schema, "_warned", set())
    caplog.set_level(logging.WARNING, logger="swarm.schema")
    return caplog


def test_a_run_record_from_a_newer_peer_parses_with_one_warning(fresh_warnings):
    run = RunConfig(model=MODEL_PRESETS["w1"], codec="int8", lr=3e-4)
    newer = run.to_dict()
    newer["model"] = {**newer["model"], "rope_theta": 10000.0, "norm": "rms"}
    newer["averaging"] = {"group_size": 4}
    for _ in range(3):  # a record read again and again (every refresh) warns once
        assert RunConfig.from_dict(newer) == run
    warnings = [r.getMessage() for r in fresh_warnings.records]
    assert len(warnings) == 1, warnings
    assert (
        "run config has fields this version does not know, left out: averaging, model.norm, "
        "model.rope_theta" in warnings[0]
    )
    # A different set of unknown names is news: it warns again.
    RunConfig.from_dict({**newer, "sharding": "none"})
    assert len(fresh_warnings.records) == 2
    # Unknown fields excuse nothing: ill-typed known ones still raise, nested ones named by their path.
    with pytest.raises(
        ValueError, match=r"run config field 'model\.d_model' must be int, got 256\.0"
    ):
        RunConfig.from_dict({**newer, "model": {**newer["model"], "d_model": 256.0}})
    with pytest.raises(ValueError, match="run config field 'lr' must be float, got True"):
        RunConfig.from_dict({**newer, "lr": True})
    with pytest.raises(ValueError, match="run config field 'model' must be a dict, got str"):
        RunConfig.from_dict({**newer, "model": "w1"})


def test_model_and_stage_records_follow_the_same_rule(fresh_warnings):
    assert ModelConfig.from_dict({"d_model": 64, "colour": "red", "depth": 2}) == ModelConfig(
        d_model=64
    )
    for _ in range(5):  # heartbeats: the same record every few seconds
        assert StageRecord.from_wire(record_wire(load_avg=0.5)).step == 3
    warnings = [r.getMessage() for r in fresh_warnings.records]
    assert (
        len(warnings) == 2 and "colour, depth" in warnings[0] and "stage record" in warnings[1]
    ), warnings


def test_the_run_record_names_its_compression_scheme_and_its_byte_ratio():
    tiny = MODEL_PRESETS["tiny"]  # d_model 128
    assert RunConfig(model=tiny).compression_scheme() == (
        "codec none: 1.0x fewer activation bytes than float32"
    )
    scheme = RunConfig(
        model=tiny.__class__(**{**tiny.to_dict(), "bottleneck_dim": 28}), codec="int4"
    )
    # 4 bytes x 128 values at full width vs 18/32 bytes x 28 values
    assert scheme.activation_bytes_ratio() == pytest.approx(4 * 128 / (18 / 32 * 28))
    assert scheme.compression_scheme() == (
        "codec int4, bottleneck 28 of 128 dims: 32.5x fewer activation bytes than float32"
    )
    assert RunConfig.from_dict(scheme.to_dict()) == scheme  # the record carries both parts


def test_a_run_whose_codec_this_build_cannot_decode_is_refused_by_name():
    record = RunConfig(codec="int2").to_dict()
    record["codec"] = "int1"  # what a newer peer might publish
    with pytest.raises(UnknownCodecError) as caught:
        RunConfig.from_dict(record)
    message = str(caught.value)
    assert "codec 'int1', which this version of swarm cannot decode" in message
    assert "(it knows none, fp16, bf16, int8, int4, int2, int4sr, int2sr)" in message
    assert "upgrade swarm on this machine to join the run" in message


def test_a_peer_and_a_trainer_refuse_to_join_a_run_whose_codec_they_cannot_decode(boot):
    """A run published by a newer version with a codec this build lacks: `swarm peer` and `swarm train` exit 1
    with one line naming the run, the codec and what to do, before serving or sending anything."""
    from swarm.discovery.dht import (
        DHTConfig,
        config_key,
        get_dht_time,
        run_signing_payload,
        start_dht,
    )

    record = RunConfig(model=ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16)).to_dict()
    record["codec"] = "int1"
    node = start_dht(DHTConfig(initial_peers=boot), client_mode=True)
    try:
        owner = (
            node.swarm_identity
        )  # the newer version's run, signed by its owner as this one expects
        signed = {
            "config": record,
            "owner": owner.public_key,
            "signature": owner.sign(run_signing_payload("from-the-future", record)),
        }
        stored = node.store(
            config_key("from-the-future"), signed, get_dht_time() + 600, subkey=owner.owner_marker
        )
        assert stored
        for command in (
            ["peer", "--stage", "0", "--threads", "1"],
            ["train", "--peers-wait-s", "5"],
        ):
            result = _cli(*command, "--run-id", "from-the-future", "--initial-peers", *boot)
            assert result.returncode == 1, result
            assert "Traceback" not in result.stderr, result.stderr
            last = result.stderr.strip().splitlines()[-1]
            assert last.startswith(
                f"swarm {command[0]}: error: run 'from-the-future': the run compresses"
            ), last
            assert "codec 'int1', which this version of swarm cannot decode" in last
            assert "upgrade swarm on this machine to join the run" in last
    finally:
        node.shutdown()


def test_gradients_may_cross_the_cuts_in_another_codec_which_the_record_names():
    run = RunConfig(codec="int2", grad_codec="int8")
    assert run.gradient_codec == "int8" and RunConfig(codec="int4").gradient_codec == "int4"
    assert run.compression_scheme().startswith("codec int2 (gradients int8): ")
    assert RunConfig.from_dict(run.to_dict()) == run
    with pytest.raises(
        ValueError, match="grad_codec 'int3' is unknown; choose same or one of none"
    ):
        RunConfig(grad_codec="int3")
    record = {**run.to_dict(), "grad_codec": "int1"}
    with pytest.raises(
        UnknownCodecError, match="compresses gradients with codec 'int1', which this version"
    ):
        RunConfig.from_dict(record)


def test_train_with_tensorboard_but_without_the_package_says_what_to_install_before_joining():
    """`swarm train --tensorboard-dir` where tensorboard is not installed (blocked here) exits 2 with one line,
    before it joins the DHT (no --initial-peers needed to get the message)."""
    block = (
        "import sys; sys.modules['tensorboard'] = None; from swarm.cli import main; "
        "sys.exit(main(['train', '--tensorboard-dir', 'tb', '--peers-wait-s', '1']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result
    assert result.stderr.strip().splitlines()[-1] == (
        "swarm train: error: --tensorboard-dir needs the tensorboard package: pip install "
        "'swarm[tensorboard]' (or tensorboard), or leave the flag out"
    )
