"""config_argv: the command line that sets a config's fields, read back by the parser built from the same config
(the harness builds every `swarm train` command line with it)."""

from __future__ import annotations

import argparse

import pytest

from swarm.argconfig import add_config_args, config_argv, config_from_args
from swarm.trainer.trainer import TrainerConfig


def _parse(argv: list[str]) -> TrainerConfig:
    parser = argparse.ArgumentParser()
    add_config_args(parser, TrainerConfig)
    return config_from_args(TrainerConfig, parser.parse_args(argv))


def test_argv_round_trips_through_the_cli_parser():
    options = dict(
        run_id="r",
        steps=7,
        in_flight=3,
        stage_step_wait_s=2.5,
        metrics_path="/tmp/m.jsonl",
        initial_peers=("@boot.addr", "/ip4/1.2.3.4/tcp/5"),  # nested DHTConfig, a tuple
        max_bytes=1000,  # nested DataConfig, optional int
        paths=("a.py", "b"),  # DataConfig's field behind the --data flag
    )
    config = _parse(config_argv(TrainerConfig, **options))
    assert config.run_id == "r" and config.steps == 7 and config.in_flight == 3
    assert config.stage_step_wait_s == 2.5 and config.metrics_path == "/tmp/m.jsonl"
    assert config.dht.initial_peers == ("@boot.addr", "/ip4/1.2.3.4/tcp/5")
    assert config.data.max_bytes == 1000 and config.data.paths == ("a.py", "b")
    assert "--data" in config_argv(TrainerConfig, paths=("x",))


def test_bools_and_none():
    assert config_argv(TrainerConfig, nat_traversal=True) == ["--nat-traversal"]
    assert config_argv(TrainerConfig, nat_traversal=False) == ["--no-nat-traversal"]
    assert config_argv(TrainerConfig, metrics_path=None) == []  # None: the field keeps its default
    assert _parse(config_argv(TrainerConfig, nat_traversal=True)).dht.nat_traversal is True


def test_an_unknown_option_is_refused_by_name():
    with pytest.raises(ValueError, match="TrainerConfig has no field in_fligth, stepz"):
        config_argv(TrainerConfig, stepz=3, in_fligth=2)
