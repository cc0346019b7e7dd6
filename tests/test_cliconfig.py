"""Flag values from a config file and SWARM_* environment variables (swarm.cliconfig): precedence, checks,
and --print-config."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from swarm.argconfig import add_config_args
from swarm.cliconfig import ConfigError, add_config_flags, apply_defaults, render


@dataclass(frozen=True)
class Knobs:
    name: str  # required: no default
    port: int = 0
    rate: float = 1.5
    fast: bool = False
    peers: tuple[str, ...] = ()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarm knobs")
    add_config_args(p, Knobs)
    p.add_argument("--level", choices=["low", "high"], default="low")
    add_config_flags(p)
    return p


def parse(argv, environ=None, *, config_text=None, tmp_path=None):
    p = parser()
    if config_text is not None:
        path = tmp_path / "swarm.toml"
        path.write_text(config_text)
        argv = ["--config", str(path), *argv]
    apply_defaults(p, "knobs", argv, environ or {})
    return p.parse_args(argv)


FILE = """
[knobs]
name = "from-file"
port = 7
fast = true
peers = ["/ip4/1.2.3.4/tcp/1", "@boot.addr"]

[other]
whatever = 1
"""


def test_the_command_line_wins_then_the_environment_then_the_file(tmp_path):
    env = {"SWARM_PORT": "8", "SWARM_RATE": "2.5"}
    args = parse(["--port", "9"], env, config_text=FILE, tmp_path=tmp_path)
    assert (args.name, args.port, args.rate, args.fast) == ("from-file", 9, 2.5, True)
    assert args.peers == ["/ip4/1.2.3.4/tcp/1", "@boot.addr"]
    args = parse([], env, config_text=FILE, tmp_path=tmp_path)
    assert args.port == 8  # the environment over the file
    args = parse([], {}, config_text=FILE, tmp_path=tmp_path)
    assert (args.port, args.rate, args.level) == (7, 1.5, "low")  # the file over the defaults


def test_a_required_flag_may_come_from_the_environment_and_switches_and_lists_parse_from_text():
    args = parse([], {"SWARM_NAME": "env", "SWARM_FAST": "yes", "SWARM_PEERS": "a b"})
    assert (args.name, args.fast, args.peers) == ("env", True, ["a", "b"])
    assert parse(["--no-fast"], {"SWARM_NAME": "x", "SWARM_FAST": "on"}).fast is False
    with pytest.raises(SystemExit):  # still required when nothing gives it
        parse([], {})


@pytest.mark.parametrize(
    "text, message",
    [
        ("[knobs]\nnmae = 'x'\n", "has 'nmae', which is no flag of swarm knobs"),
        ("name = 'x'\n", "name outside any table; put settings under the command"),
        ("[knobs]\nport = 'seven'\n", "port: invalid int value 'seven'"),
        ("[knobs]\nfast = 1\n", "fast must be true or false, got 1"),
        ("[knobs]\nlevel = 'max'\n", "'max' is not one of low, high"),
        ("[knobs\n", "is not valid TOML"),
    ],
)
def test_a_file_that_does_not_fit_the_flags_is_refused_naming_what(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse([], {}, config_text=text, tmp_path=tmp_path)


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"SWARM_PORT": "x"}, "SWARM_PORT: invalid int value 'x'"),
        ({"SWARM_FAST": "maybe"}, "SWARM_FAST must be one of 1/0, true/false"),
    ],
)
def test_an_environment_value_that_does_not_fit_is_refused_naming_the_variable(environ, message):
    with pytest.raises(ConfigError, match=message):
        parse(["--name", "n"], environ)


def test_a_missing_config_file_is_refused():
    with pytest.raises(ConfigError, match="cannot read the config file /nonexistent.toml"):
        apply_defaults(parser(), "knobs", ["--config", "/nonexistent.toml"], {})


def test_print_config_writes_a_file_that_reads_back_to_the_same_values(tmp_path):
    p = parser()
    args = p.parse_args(["--name", 'a "quoted" name', "--port", "3", "--fast", "--peers", "x", "y"])
    text = render(p, "knobs", args)
    again = parse([], {}, config_text=text, tmp_path=tmp_path)

    def values(ns):
        return {
            dest: getattr(ns, dest) for dest in ("name", "port", "rate", "fast", "peers", "level")
        }

    assert values(again) == values(args)


@pytest.mark.integration
def test_swarm_reads_its_flags_from_a_file_and_the_environment_and_says_what_is_wrong(tmp_path):
    config = tmp_path / "swarm.toml"
    config.write_text('[status]\nrun_id = "from-file"\ninitial_peers = ["@boot.addr"]\n')

    def swarm(*args, **env):
        return subprocess.run(
            [sys.executable, "-m", "swarm", "status", "--config", str(config), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env},
        )

    done = swarm("--print-config", SWARM_DHT_PORT="4242")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("[status]\n")
    assert 'run_id = "from-file"' in done.stdout and "dht_port = 4242" in done.stdout
    assert 'initial_peers = ["@boot.addr"]' in done.stdout
    assert 'run_id = "cli"' in swarm("--run-id", "cli", "--print-config").stdout
    config.write_text("[status]\nrun_idd = 'x'\n")
    done = swarm("--print-config")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"swarm status: error: {config}: [status] has 'run_idd', which is no flag of swarm status; "
        f"see swarm status --help"
    )
