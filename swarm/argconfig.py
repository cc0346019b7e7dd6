"""Build argparse flags from config dataclasses, so the CLI is not a second list of options.

Each field becomes ``--field-name`` with its default, its type and, as help, the comment written next to
(or just above) the field in the dataclass source. Nested dataclass fields are flattened: their fields
become flags of the same command (names are unique across a command's configs by design).

A field may list its allowed values (``field(..., metadata={"choices": ...})``); ``--help`` shows them and
argparse refuses others. A config class may title its group of flags (``FLAG_TITLE``, default: the class
name) and send some fields to another group (``FLAG_GROUPS``: field name -> title). Groups titled
"advanced: ..." are listed last in ``--help`` (:func:`advanced_last`), so a command shows its essentials first.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import linecache
import re
import typing
from typing import Any

_SCALARS = {"int": int, "float": float, "str": str}


def _class_lines(cls: type) -> list[str]:
    """The source lines of top-level class ``cls``, read from its module's file. Not ``inspect.getsource``: it
    parses the whole module with ``ast``, which on CPython 3.11.7 now and then fails with "AST constructor
    recursion depth mismatch" (a CPython bug, seen in CI building the CLI's parser). Raises OSError when the source
    is not there."""
    path = inspect.getsourcefile(cls)
    if path is None:
        raise OSError(f"no source file for {cls.__qualname__}")
    lines = linecache.getlines(path)
    header = re.compile(rf"class {re.escape(cls.__name__)}\b")
    start = next((i for i, line in enumerate(lines) if header.match(line)), None)
    if start is None:
        raise OSError(f"class {cls.__qualname__} is not at the top level of {path}")
    body = [lines[start].rstrip("\n")]
    for line in lines[start + 1 :]:
        if line.strip() and not line[0].isspace():
            break
        body.append(line.rstrip("\n"))
    return body


def _field_comments(cls: type) -> dict[str, str]:
    comments: dict[str, str] = {}
    try:
        lines = _class_lines(cls)
    except (OSError, TypeError):
        return comments
    above: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        match = re.match(r"(\w+)\s*:[^=#]+(?:=.*?)?(?:#\s*(.*))?$", stripped)
        if match:
            comments[match.group(1)] = match.group(2) or " ".join(above)
        above = []
    return comments


def _nested(field: dataclasses.Field) -> type | None:
    factory = field.default_factory
    if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
        return factory
    return None


def _base_type(annotation) -> tuple[str, bool]:
    """('int' | 'float' | 'str' | 'bool' | 'tuple', optional?) for the annotations our configs use."""
    if not isinstance(annotation, str):
        annotation = getattr(annotation, "__name__", str(annotation))
    parts = [p.strip() for p in annotation.split("|")]
    optional = "None" in parts
    base = next(p for p in parts if p != "None")
    if base.startswith("tuple["):
        return "tuple", optional
    if base not in (*_SCALARS, "bool"):
        raise TypeError(f"unsupported config field type {annotation!r}")
    return base, optional


def add_config_args(
    parser: argparse.ArgumentParser, cls: type, *, skip: typing.Collection[str] = ()
) -> None:
    comments = _field_comments(cls)
    titles: dict[str, str] = getattr(cls, "FLAG_GROUPS", {})
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        nested = _nested(field)
        if nested is not None:
            add_config_args(parser, nested, skip=skip)
            continue
        group = _group(parser, titles.get(field.name, getattr(cls, "FLAG_TITLE", cls.__name__)))
        flag = field.metadata.get("flag", "--" + field.name.replace("_", "-"))
        default = field.default if field.default is not dataclasses.MISSING else None
        kind, optional = _base_type(field.type)
        help_text = comments.get(field.name, "").replace("%", "%%")
        if kind == "bool":
            shown = "" if default is None else f" (default: {'on' if default else 'off'})"
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text + shown,
                dest=field.name,
            )
        elif kind == "tuple":
            group.add_argument(
                flag,
                nargs="+",
                default=default,
                metavar=field.name.upper(),
                help=help_text,
                dest=field.name,
            )
        else:
            shown = "" if default is None else f" (default: {default})"
            group.add_argument(
                flag,
                type=_SCALARS[kind],
                default=default,
                choices=field.metadata.get("choices"),
                help=help_text + shown,
                required=default is None and not optional,
                dest=field.name,
            )


def _group(parser: argparse.ArgumentParser, title: str):
    """The parser's argument group titled ``title``, created on first use."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def advanced_last(parser: argparse.ArgumentParser) -> None:
    """Move the groups titled "advanced: ..." to the end of ``parser``'s help, in their order."""
    groups = parser._action_groups
    groups.sort(key=lambda group: bool(group.title and group.title.startswith("advanced")))


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any):
    """Instantiate ``cls`` (and its nested configs) from parsed args; ``overrides`` win over args."""
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name in overrides:
            kwargs[field.name] = overrides[field.name]
            continue
        nested = _nested(field)
        if nested is not None:
            kwargs[field.name] = config_from_args(nested, args)
        elif hasattr(args, field.name):
            value = getattr(args, field.name)
            kwargs[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def _flags_of(cls: type) -> dict[str, tuple[str, str]]:
    """{field name: (flag, kind)} of ``cls`` and its nested configs, as add_config_args makes them."""
    out: dict[str, tuple[str, str]] = {}
    for field in dataclasses.fields(cls):
        nested = _nested(field)
        if nested is not None:
            out.update(_flags_of(nested))
            continue
        flag = field.metadata.get("flag", "--" + field.name.replace("_", "-"))
        out[field.name] = (flag, _base_type(field.type)[0])
    return out


def config_argv(cls: type, **options: Any) -> list[str]:
    """The command-line flags that set ``options`` (field names of ``cls`` or its nested configs) on the
    command whose flags add_config_args built from ``cls``: the inverse of config_from_args, so a caller
    that starts a command builds its argv from the config's names. None leaves a field at its default.
    ValueError names an option that is no field."""
    flags = _flags_of(cls)
    unknown = sorted(set(options) - set(flags))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}")
    argv: list[str] = []
    for name, value in options.items():
        flag, kind = flags[name]
        if value is None:
            continue
        if kind == "bool":
            argv.append(flag if value else "--no-" + flag[2:])
        elif kind == "tuple":
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv
