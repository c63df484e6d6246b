"""Dataclass configs as the single source of truth for defaults, validation, YAML and CLI flags.

Each component declares a ``@dataclass(kw_only=True)`` whose fields are made with :func:`opt`
(default + help text). From that one declaration we derive:

* the argparse flags (``batch_size`` -> ``--batch-size``), see :func:`add_args`;
* construction from a YAML mapping with unknown keys refused, see :func:`from_dict` (a field's older
  names, its ``aliases``, are read as it: config.yaml files and checkpoints written before a rename);
* validation in ``__post_init__`` via :func:`check`, whose message names the flag and the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

from streamnmt.errors import ConfigError

T = TypeVar("T")


def opt(default: Any, help: str, *, choices: tuple | None = None, cli: bool = True, const: Any = None,
        aliases: tuple[str, ...] = ()) -> Any:
    """A config field: ``default`` plus the help text shown by ``--help``; with ``const``, the flag
    may be given without a value, meaning ``const`` (``--compile`` = ``--compile on``); ``aliases``:
    the field's older names, still read as config keys and flags."""
    meta = {"help": help, "choices": choices, "cli": cli, "const": const, "aliases": aliases}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def check(ok: bool, key: str, message: str) -> None:
    """Raise a ConfigError naming ``key`` (as flag and YAML key) unless ``ok``."""
    if not ok:
        error = ConfigError(f"{flag_name(key)} (config key '{key}'): {message}")
        error.key = key  # type: ignore[attr-defined]  # a value from a config file: the file is named too
        raise error


def check_choice(value: Any, key: str, choices: tuple) -> None:
    check(value in choices, key, f"must be one of {', '.join(map(str, choices))}; got {value!r}")


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(underlying type, optional?) for annotations like ``int``, ``str | None``."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(__import__("builtins")))  # noqa: S307 - our own annotations
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    typ, optional = _base_type(annotation)
    if value is None:
        check(optional, key, "must not be empty")
        return None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        check(False, key, f"must be true or false; got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            check(False, key, f"must be an integer; got {value!r}")
        try:
            return int(value)
        except ValueError:
            check(False, key, f"must be an integer; got {value!r}")
    if typ is float:
        if isinstance(value, bool):
            check(False, key, f"must be a number; got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            check(False, key, f"must be a number; got {value!r}")
    if typ is str:
        check(isinstance(value, (str, int, float)), key, f"must be a string; got {value!r}")
        return str(value)
    if typing.get_origin(typ) is list:  # list[str]: several values after one flag, or a YAML list
        items = [value] if isinstance(value, str) else value
        check(isinstance(items, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in items), key,
              f"must be a list of strings; got {value!r}")
        return [str(v) for v in items]
    return value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def names_of(cls: type) -> dict[str, str]:
    """Every config key ``cls`` reads, its fields' names and their older names (``aliases``), to the
    field's name."""
    return {name: f.name for f in dataclasses.fields(cls) for name in (f.name, *f.metadata.get("aliases", ()))}


def canonical(cls: type, values: dict[str, Any], where: str = "") -> dict[str, Any]:
    """``values`` with every field's older name (its ``aliases``) replaced by the field's name; a
    mapping that gives both, with different values, raises ConfigError (an older key set to None counts
    as not given). Other keys pass as they are."""
    renamed = {key: name for key, name in names_of(cls).items() if key != name}
    out = {k: v for k, v in values.items() if k not in renamed}
    for key, value in values.items():
        if key in renamed and value is not None:
            name = renamed[key]
            if name in out and out[name] != value:
                raise ConfigError(f"{where}config key '{key}' is the older name of '{name}', and both are given "
                                  f"({value!r}, {out[name]!r}): give '{name}' alone")
            out[name] = value
    return out


def from_dict(cls: type[T], values: dict[str, Any], where: str = "") -> T:
    """Build ``cls`` from a mapping; unknown keys and badly typed values raise ConfigError."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in canonical(cls, values, where).items():
        if key not in names:
            raise ConfigError(f"{where}unknown config key '{key}'; known keys: {', '.join(sorted(names))}")
        kwargs[key] = _coerce(value, hints[key], key)
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def add_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """Add one flag per CLI field of ``cls``. Defaults are SUPPRESSed so only given flags count."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        typ, _ = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f.metadata.get("help", "")
        if default is not None and "default" not in help_text:  # None: the help says what happens
            help_text += f" (default: {default})"
        # argparse %-formats help strings: a literal "10 %" would make --help itself fail
        kw: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"))
        flags = [flag_name(f.name), *map(flag_name, f.metadata.get("aliases", ()))]
        if typ is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
            continue
        # Values arrive as strings and are coerced (and validated) by from_dict, so that a bad
        # flag and a bad YAML value give the same message.
        kw["metavar"] = typ.__name__.upper() if typ in (int, float) else "VALUE"
        if typing.get_origin(typ) is list:
            kw["nargs"] = "+"
        if f.metadata.get("choices"):
            kw["metavar"] = "{" + ",".join(map(str, f.metadata["choices"])) + "}"
        if f.metadata.get("const") is not None:
            kw.update(nargs="?", const=f.metadata["const"])
        parser.add_argument(*flags, **kw)


def pick(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that are fields of ``cls`` (older names read as the field's)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in canonical(cls, values).items() if k in names}
