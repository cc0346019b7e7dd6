"""Configs, records and flags: bad values fail early with a sentence that has the numbers in it."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from swarm.config import RunConfig
from swarm.discovery.records import RecordError, StageRecord
from swarm.model import MODEL_PRESETS, ModelConfig
from swarm.states import PeerState


def test_run_config_validation_names_the_numbers():
    with pytest.raises(ValueError, match="codec 'gzip' is unknown; choose one of none, fp16, bf16, int8"):
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
    with pytest.raises(ValueError, match="must be a dict with a 'model' dict"):
        RunConfig.from_dict([1, 2])
    assert run.fingerprint() == RunConfig.from_dict(run.to_dict()).fingerprint()
    assert run.fingerprint() != RunConfig(model=MODEL_PRESETS["w1"]).fingerprint()


def test_learning_rate_schedule_warms_up_then_decays_to_a_tenth():
    run = RunConfig(lr=1e-3, warmup_steps=10, total_steps=110)
    assert run.lr_at(0) == pytest.approx(1e-4)
    assert run.lr_at(9) == pytest.approx(1e-3)
    assert run.lr_at(60) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert run.lr_at(110) == pytest.approx(1e-4) and run.lr_at(500) == pytest.approx(1e-4)
    assert RunConfig(lr=1e-3, warmup_steps=0).lr_at(1000) == 1e-3


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


def _record(**overrides):
    base = dict(peer_id="p", endpoint="127.0.0.1:1", stage=0, state="serving", throughput=10.0, in_flight=0,
                step=3, config_hash="abc")
    return {**base, **overrides}


def test_stage_records_are_validated_and_forward_compatible():
    record = StageRecord.from_wire(_record())
    assert record.throughput == 10.0 and record.state is PeerState.SERVING
    wire = record.to_wire()  # what the DHT stores: the state as its plain string, back to the same record
    assert type(wire["state"]) is str and wire["state"] == "serving" and StageRecord.from_wire(wire) == record
    assert StageRecord.from_wire(_record(extra="from a newer peer")).step == 3
    assert StageRecord.from_wire(_record(throughput=7)).throughput == 7.0  # ints are fine
    for bad, needle in [(_record(throughput=math.nan), "out-of-range"), (_record(state="dancing"), "state"),
                        (_record(step="3"), "'step' must be int"), (_record(endpoint="nowhere"), "endpoint"),
                        ({k: v for k, v in _record().items() if k != "endpoint"}, "lacks field 'endpoint'"),
                        ("not a dict", "must be a dict")]:
        with pytest.raises(RecordError, match=needle):
            StageRecord.from_wire(bad)


def test_model_presets_are_the_standard_workloads():
    assert MODEL_PRESETS["w1"] == ModelConfig(d_model=256, n_heads=4, n_layers=4, seq_len=128, num_stages=2)
    assert MODEL_PRESETS["w2"].d_model == 512 and MODEL_PRESETS["w2"].seq_len == 256
    assert MODEL_PRESETS["w3"].num_stages == 3 and len(MODEL_PRESETS["w3"].stage_layers(0)) == 4


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["peer", "--stage", "-2"], "stage must be >= 0, got -2"),
    (["train", "--microbatch-size", "0"], "microbatch_size (0)"),
    (["peer", "--preset", "huge"], "invalid choice: 'huge'"),
    (["train", "--steps", "many"], "invalid int value: 'many'"),
    (["peer", "--announce-host", "10.0.0.1"], "--announce-host needs an explicit --dht-port"),
])
def test_bad_flags_exit_2_with_a_clear_message(args, needle):
    result = _cli(*args)
    assert result.returncode == 2, result
    assert needle in result.stderr, result.stderr


def test_help_text_comes_from_the_config_comments():
    out = " ".join(_cli("peer", "--help").stdout.split())  # argparse wraps lines
    assert "announcement lifetime: a silent peer disappears from routing after this" in out
    assert "--data" in _cli("train", "--help").stdout
