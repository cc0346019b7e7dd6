"""Flag values from a config file and the environment, under the command line.

Every flag of a ``swarm`` command can also be set

- in a TOML file given with ``--config FILE``, in the table named after the command (``[peer]``, ``[train]``,
  ...), keys spelt like the flags without dashes (``initial_peers`` or ``initial-peers``);
- in the environment, as ``SWARM_`` + the flag's name in capitals (``SWARM_INITIAL_PEERS``, ``SWARM_RUN_ID``);
  a list is written space-separated, a switch as 1/0, true/false, yes/no or on/off.

Precedence, highest first: the command line, the environment, the config file, the built-in default.
``--print-config`` prints the values a command would run with, as a config file, and exits. A key or value
that does not fit a flag is an error naming it (exit status 2), never ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10
    import tomli as tomllib

ENV_PREFIX = "SWARM_"
# Flags of the parser itself, not settings of a command.
_NOT_SETTINGS = {"help", "config", "print_config", "version"}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A config file or environment value that does not fit the command's flags."""


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("configuration")
    group.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="read flag values from this TOML file's [COMMAND] table (the command line and SWARM_* "
        "environment variables win over it)",
    )
    group.add_argument(
        "--print-config",
        action="store_true",
        help="print the values this command would run with, as a config file, and exit",
    )


def settings(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The command's settable flags: dest -> action."""
    return {
        action.dest: action
        for action in parser._actions
        if action.dest not in _NOT_SETTINGS and action.option_strings
    }


def apply_defaults(
    parser: argparse.ArgumentParser,
    command: str,
    argv: list[str],
    environ: dict[str, str] | None = None,
) -> None:
    """Set ``parser``'s defaults (the parser of ``command``) from the config file named in ``argv`` and from
    ``environ`` (default: the process environment), the environment over the file. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    actions = settings(parser)
    values: dict[str, Any] = {}
    path = _config_path(argv)
    if path is not None:
        for key, value in _read_table(path, command).items():
            dest = key.replace("-", "_")
            if dest not in actions:
                raise ConfigError(
                    f"{path}: [{command}] has '{key}', which is no flag of swarm {command}; see "
                    f"swarm {command} --help"
                )
            values[dest] = _from_toml(actions[dest], value, f"{path}: [{command}] {key}")
    for dest, action in actions.items():
        name = ENV_PREFIX + dest.upper()
        if name in environ:
            values[dest] = _from_text(action, environ[name], name)
    for dest in values:
        actions[dest].required = False  # given, just not on the command line
    parser.set_defaults(**values)


def render(parser: argparse.ArgumentParser, command: str, args: argparse.Namespace) -> str:
    """``args`` as the [command] table of a config file (unset values left out, as comments)."""
    lines = [f"[{command}]"]
    for dest in sorted(settings(parser)):
        value = getattr(args, dest, None)
        if value is None:
            lines.append(f"# {dest} = (not set)")
        else:
            lines.append(f"{dest} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _config_path(argv: list[str]) -> Path | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    return None


def _read_table(path: Path, command: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    stray = [key for key, value in data.items() if not isinstance(value, dict)]
    if stray:
        raise ConfigError(
            f"{path}: {', '.join(stray)} outside any table; put settings under the command they are for, "
            f"e.g. [{command}]"
        )
    return data.get(command, {})


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        return "bool"
    if action.nargs in ("+", "*"):
        return "list"
    return "scalar"


def _from_toml(action: argparse.Action, value: Any, where: str) -> Any:
    kind = _kind(action)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if kind == "list":
        items = value if isinstance(value, list) else [value]
        return [_convert(action, item, where) for item in items]
    if isinstance(value, (list, dict, bool)):
        raise ConfigError(f"{where} must be a single value, got {value!r}")
    return _convert(action, value, where)


def _from_text(action: argparse.Action, text: str, where: str) -> Any:
    kind = _kind(action)
    if kind == "bool":
        lowered = text.strip().lower()
        if lowered not in _TRUE | _FALSE:
            raise ConfigError(
                f"{where} must be one of 1/0, true/false, yes/no, on/off; got {text!r}"
            )
        return lowered in _TRUE
    if kind == "list":
        return [_convert(action, item, where) for item in text.split()]
    return _convert(action, text, where)


def _convert(action: argparse.Action, value: Any, where: str) -> Any:
    convert = action.type or str
    try:
        converted = convert(value if isinstance(value, str) else str(value))
    except (TypeError, ValueError):
        name = getattr(convert, "__name__", "value")
        raise ConfigError(f"{where}: invalid {name} value {value!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(
            f"{where}: {converted!r} is not one of {', '.join(map(str, action.choices))}"
        )
    return converted


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string is a JSON string for our values
