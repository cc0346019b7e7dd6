"""One parser for records read from other processes (the DHT, checkpoints, JSON files) into dataclasses.

The rule every record follows, so a newer peer's record never breaks an older reader:

* unknown fields are left out, with a warning logged once per distinct set of unknown names (heartbeats
  repeat the same record every few seconds; the log must not);
* a missing field takes the dataclass default; a field without default (or named in ``required``) must
  be present;
* a field of the wrong type raises ``ValueError`` naming it: ``str``, ``int`` (a ``bool`` is not one),
  ``float`` (an ``int`` is widened; with ``finite`` NaN and infinities are refused), ``bool``, an ``Enum``
  (given as one of its values), ``X | None``, a ``dict`` with string keys, and nested dataclasses, parsed by the
  same rule; a union of dataclasses is told apart by the record's "family" value (each class lists the ones it
  reads in ``FAMILIES``; None stands for a record without that key); a class that lists ``FAMILIES`` without a
  ``family`` field (it derives it, a property) reads the key as a check: a value it does not list, or one its
  parsed fields do not give, is refused;
* the dataclass's own ``__post_init__`` then checks the values (``ValueError`` too).

Stdlib only: the bottom of the tree, beside ``swarm.errors``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import math
import types
import typing
from collections.abc import Collection
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Sets of unknown field names already warned about, per kind of record; bounded, since remote peers choose
# the names (past the bound the warnings stop, the parsing does not).
_warned: set[tuple[str, frozenset[str]]] = set()
_MAX_WARNED = 1024
_FAMILY = "family"  # the key that tells the dataclasses of a union apart


def parse_dataclass(
    cls: type[T], data: Any, *, what: str, finite: bool = False, required: Collection[str] = ()
) -> T:
    """Build ``cls`` from the untrusted dict ``data`` by the module's rule.

    ``what`` names the record in messages ("stage record", "run config"); ``finite`` refuses NaN and
    infinite floats; ``required`` lists fields that must be present although they have a default.
    Raises ``ValueError`` naming the field (nested ones as ``outer.inner``).
    """
    unknown: list[str] = []
    value = _parse(
        cls, data, what=what, prefix="", finite=finite, required=required, unknown=unknown
    )
    if unknown:
        _warn_unknown(what, unknown)
    return value


def _parse(
    cls: type,
    data: Any,
    *,
    what: str,
    prefix: str,
    finite: bool,
    required: Collection[str],
    unknown: list[str],
):
    if not isinstance(data, dict):
        where = f"{what} field '{prefix[:-1]}'" if prefix else what
        raise ValueError(f"{where} must be a dict, got {type(data).__name__}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    # a class that lists FAMILIES but has no "family" field reads the key as the discriminator (a property)
    family = _FAMILY in data and _FAMILY not in fields and hasattr(cls, "FAMILIES")
    if family and data[_FAMILY] not in cls.FAMILIES:
        raise ValueError(
            f"{what} has family {data[_FAMILY]!r}, which this version does not read as {cls.__name__} (it reads "
            f"{', '.join(str(f) for f in cls.FAMILIES)}); upgrade swarm to read it"
        )
    unknown.extend(
        prefix + str(key) for key in data if key not in fields and not (family and key == _FAMILY)
    )
    kwargs = {}
    for name, f in fields.items():
        label = prefix + name
        if name not in data:
            has_default = (
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            )
            if has_default and label not in required:
                continue
            raise ValueError(f"{what} lacks field '{label}'")
        kwargs[name] = _value(
            hints[name],
            data[name],
            what=what,
            label=label,
            finite=finite,
            required=required,
            unknown=unknown,
        )
    value = cls(**kwargs)
    if family and getattr(value, _FAMILY, None) != data[_FAMILY]:
        raise ValueError(
            f"{what} says family {data[_FAMILY]!r}, but its fields describe family "
            f"{getattr(value, _FAMILY, None)!r}: the record is inconsistent"
        )
    return value


def _value(
    hint,
    value: Any,
    *,
    what: str,
    label: str,
    finite: bool,
    required: Collection[str],
    unknown: list[str],
):
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    options = typing.get_args(hint) if union else (hint,)
    if value is None and type(None) in options:
        return None
    kind = next(t for t in options if t is not type(None))
    records = [t for t in options if dataclasses.is_dataclass(t)]
    if len(records) > 1:
        kind = _record_kind(records, value, what=what, label=label)
    if dataclasses.is_dataclass(kind):
        return _parse(
            kind,
            value,
            what=what,
            prefix=f"{label}.",
            finite=finite,
            required=required,
            unknown=unknown,
        )
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value)
        except ValueError:
            raise ValueError(
                f"{what} field '{label}' must be one of {[m.value for m in kind]}, got {value!r}"
            ) from None
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and (not finite or math.isfinite(value))
        )
    elif kind is str:
        ok = isinstance(value, str)
    elif typing.get_origin(kind) is dict or kind is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
    else:
        raise TypeError(f"parse_dataclass cannot read field '{label}' of type {hint!r}")
    if not ok:
        expected = " or ".join(
            "None" if t is type(None) else getattr(t, "__name__", str(t)) for t in options
        )
        if kind is float and finite:
            expected = f"a finite {expected}"
        raise ValueError(f"{what} field '{label}' must be {expected}, got {value!r}")
    return float(value) if kind is float else value


def _record_kind(kinds: list[type], value: Any, *, what: str, label: str) -> type:
    """Which of several dataclasses a record is: the one whose ``FAMILIES`` holds its "family" value (None when
    it has no "family" key)."""
    family = value.get("family") if isinstance(value, dict) else None
    for kind in kinds:
        if family in getattr(kind, "FAMILIES", ()):
            return kind
    known = sorted(str(f) for kind in kinds for f in getattr(kind, "FAMILIES", ()) if f is not None)
    raise ValueError(
        f"{what} field '{label}' has family {family!r}, which this version does not know (it knows "
        f"{', '.join(known)}); upgrade swarm to read it"
    )


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _warn_unknown(what: str, names: list[str]) -> None:
    key = (what, frozenset(names))
    if key in _warned or len(_warned) >= _MAX_WARNED:
        return
    _warned.add(key)
    logger.warning(
        "%s has fields this version does not know, left out: %s (written by a newer version?)",
        what,
        ", ".join(sorted(names)),
    )


def check_field_types(
    config: Any,
    *,
    numbers: Collection[str] = (),
    ints: Collection[str] = (),
    bools: Collection[str] = (),
) -> None:
    """Check that a config built in code holds what its annotations say (a dataclass constructor checks
    nothing): ``numbers`` are finite ints or floats, ``ints`` ints, ``bools`` bools; a ``bool`` is never a
    number. For ``__post_init__``, before the range checks. Raises ``ValueError`` naming ``Class.field``."""
    name = type(config).__name__
    for field in numbers:
        value = getattr(config, field)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ValueError(f"{name}.{field} must be a finite number, got {value!r}")
    for field in ints:
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}.{field} must be an int, got {value!r}")
    for field in bools:
        value = getattr(config, field)
        if not isinstance(value, bool):
            raise ValueError(f"{name}.{field} must be a bool, got {value!r}")
