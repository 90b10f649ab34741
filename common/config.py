"""Role configuration: one TOML file per role, every key overridable by a flag.

A role's settings are a dataclass whose fields are declared with `setting()`.
The same declaration drives the TOML reader, the command-line flags, the
validation (with errors that name the file or flag and the key) and
`--print-config`.  Nested dataclasses are TOML tables; their flags are
`--table-key`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import sys
import typing
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6)
    import tomli as tomllib

T = TypeVar("T")
Check = Callable[[Any], "str | None"]


class ConfigError(ValueError):
    """A configuration value was wrong; the message says where and why."""


def setting(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    choices: tuple[Any, ...] | None = None,
    check: Check | None = None,
    flag: str | None = None,
    aliases: dict[str, str] | None = None,
) -> Any:
    """Declare a configuration key: its default, help text and constraints.

    `flag` replaces the derived `--table-key` name where a shorter one is expected.
    `aliases` maps old names of choices to their new names: accepted, with a warning.
    """
    metadata = {
        "help": help,
        "min": min,
        "max": max,
        "choices": choices,
        "check": check,
        "flag": flag,
        "aliases": aliases or {},
    }
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type, help: str) -> Any:
    """Declare a nested table of settings."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "section": True})


@dataclasses.dataclass(frozen=True)
class _Key:
    path: tuple[str, ...]  # ("security", "insecure")
    type: Any
    field: dataclasses.Field

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def flag(self) -> str:
        return self.field.metadata["flag"] or "--" + "-".join(self.path).replace("_", "-")

    @property
    def dest(self) -> str:
        return "cfg__" + "__".join(self.path)


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _keys(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[_Key]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            yield from _keys(hints[f.name], (*prefix, f.name))
        elif hints[f.name] not in _TYPE_NAMES:
            raise TypeError(
                f"{cls.__name__}.{f.name}: settings are bool, int, float or str, not {hints[f.name]}"
            )
        else:
            yield _Key((*prefix, f.name), hints[f.name], f)


# ---------------------------------------------------------------- values


def _coerce(key: _Key, value: Any, *, from_text: bool) -> Any:
    """Turn a TOML value (or flag text) into the key's type, or say what is wrong."""
    tp = key.type
    if from_text:
        value = _parse_text(tp, value)
    if tp is bool:
        ok = type(value) is bool
    elif tp is int:
        ok = type(value) is int
    elif tp is float:
        ok = type(value) in (int, float) and math.isfinite(value)
        value = float(value) if ok else value
    else:
        ok = type(value) is str
    if not ok:
        raise ValueError(f"must be {_TYPE_NAMES[tp]}, got {value!r}")
    meta = key.field.metadata
    if isinstance(value, str) and value in meta["aliases"]:
        new = meta["aliases"][value]
        # FutureWarning: shown to the user who wrote it (DeprecationWarning is hidden outside __main__).
        warnings.warn(
            f"{key.flag} (key '{key.dotted}'): {value!r} is the old name of {new!r}; it will go, use {new!r}",
            FutureWarning,
            stacklevel=2,
        )
        value = new
    if meta["min"] is not None and value < meta["min"]:
        raise ValueError(f"must be >= {meta['min']}, got {value!r}")
    if meta["max"] is not None and value > meta["max"]:
        raise ValueError(f"must be <= {meta['max']}, got {value!r}")
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ValueError(f"must be one of {', '.join(map(str, meta['choices']))}; got {value!r}")
    if meta["check"] is not None:
        problem = meta["check"](value)
        if problem:
            raise ValueError(f"{problem}; got {value!r}")
    return value


def _parse_text(tp: Any, text: str) -> Any:
    if tp is bool:
        lowered = text.lower()
        if lowered in ("true", "yes", "1", "on"):
            return True
        if lowered in ("false", "no", "0", "off"):
            return False
        return text
    if tp is int:
        try:
            return int(text)
        except ValueError:
            return text
    if tp is float:
        try:
            return float(text)
        except ValueError:
            return text
    return text


# ---------------------------------------------------------------- loading


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file, turning every failure into a ConfigError naming the file."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None


def _unknown(name: str, known: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigError(f"{where}: unknown key '{name}'{hint}")


def _from_table(cls: type[T], table: dict[str, Any], source: str, prefix: tuple[str, ...]) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    table_name = f" [{'.'.join(prefix)}]" if prefix else ""
    for name, raw in table.items():
        f = fields.get(name)
        if f is None:
            raise _unknown(name, list(fields), f"{source}{table_name}")
        if f.metadata.get("section"):
            if not isinstance(raw, dict):
                raise ConfigError(f"{source}: '{'.'.join((*prefix, name))}' must be a table")
            values[name] = _from_table(hints[name], raw, source, (*prefix, name))
            continue
        key = _Key((*prefix, name), hints[name], f)
        try:
            values[name] = _coerce(key, raw, from_text=False)
        except ValueError as exc:
            raise ConfigError(f"{source}: key '{key.dotted}' {exc}") from None
    return cls(**values)


def load(cls: type[T], path: Path | None = None, overrides: dict[str, str] | None = None) -> T:
    """Defaults, then the file, then overrides (dotted key -> flag text), all validated."""
    keys = {k.dotted: k for k in _keys(cls)}  # also refuses settings of unsupported types
    config = _from_table(cls, read_toml(path), str(path), ()) if path else cls()
    for dotted, text in (overrides or {}).items():
        key = keys.get(dotted)
        if key is None:
            raise _unknown(dotted, list(keys), "override")
        try:
            value = _coerce(key, text, from_text=True)
        except ValueError as exc:
            raise ConfigError(f"{key.flag}: {exc}") from None
        config = _replace_path(config, key.path, value)
    return config


def _replace_path(obj: Any, path: tuple[str, ...], value: Any) -> Any:
    if len(path) == 1:
        return dataclasses.replace(obj, **{path[0]: value})
    inner = _replace_path(getattr(obj, path[0]), path[1:], value)
    return dataclasses.replace(obj, **{path[0]: inner})


# ---------------------------------------------------------------- flags and printing


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per key, plus --config FILE and --print-config."""
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML config file for this role")
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective configuration as TOML and exit"
    )
    group = parser.add_argument_group("settings (each overrides the config file)")
    for key in _keys(cls):
        meta = key.field.metadata
        default = key.field.default
        extra = f" (choices: {', '.join(map(str, meta['choices']))})" if meta["choices"] else ""
        if key.type is bool:  # `--flag` alone means true; `--flag false` also works
            kwargs: dict[str, Any] = {"nargs": "?", "const": "true", "metavar": "BOOL"}
        else:
            kwargs = {"metavar": key.path[-1].upper()}
        group.add_argument(
            key.flag,
            dest=key.dest,
            default=None,
            # argparse formats help with %: a literal % in a setting's text must not break --help.
            help=f"{meta['help']}{extra} [default: {default}]".replace("%", "%%"),
            **kwargs,
        )


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The effective config for parsed arguments made by `add_flags`."""
    overrides = {
        key.dotted: getattr(args, key.dest) for key in _keys(cls) if getattr(args, key.dest, None) is not None
    }
    return load(cls, args.config, overrides)


def to_toml(config: Any) -> str:
    """The config as a TOML document that `load` reads back to an equal config."""
    lines: list[str] = []
    _emit(config, (), lines)
    return "\n".join(lines).strip() + "\n"


def _emit(obj: Any, prefix: tuple[str, ...], lines: list[str]) -> None:
    tables = []
    if prefix:
        lines.append(f"\n[{'.'.join(prefix)}]")
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("section"):
            tables.append((f.name, value))
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    for name, value in tables:
        _emit(value, (*prefix, name), lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a JSON string is a valid TOML basic string
