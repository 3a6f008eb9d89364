"""Strict loading of TOML tables into frozen dataclasses.

Every config class in slurm-omni is a ``@dataclass(frozen=True, kw_only=True, slots=True)`` whose
fields have defaults or are required, and whose ``__post_init__`` rejects bad combinations. This
module turns a parsed TOML table into such a class and names the file, the key, the value and what
is allowed when something is off.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from slurm_omni.errors import ConfigError
from slurm_omni.fsio import FileRejected, read_text

MAX_CONFIG_BYTES = 4 << 20

T = TypeVar("T")


def read_toml(path: Path) -> dict[str, Any]:
    """Parse ``path`` as TOML; a missing file or a syntax error is one ConfigError line."""
    try:
        return tomllib.loads(read_text(path, MAX_CONFIG_BYTES, what=str(path), follow=True))
    except FileRejected as e:
        raise ConfigError(f"config: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config: couldn't parse {path}: {e} (TOML syntax)") from e
    except RecursionError:
        raise ConfigError(f"config: couldn't parse {path}: nested too deep (TOML syntax)") from None


def load_dataclass(cls: type[T], table: Any, *, source: str, prefix: str = "") -> T:
    """Build ``cls`` from ``table``; ``source`` is the file name used in messages, ``prefix`` the
    dotted key of ``table`` inside it."""
    where = prefix or "<top level>"
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {where}: expected a table, got {type(table).__name__} {table!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(table) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields))
        raise ConfigError(f"{source}: unknown key {_dotted(prefix, unknown[0])!r} (allowed: {allowed})")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        key = _dotted(prefix, name)
        if name not in table:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{source}: missing required key {key!r}")
            continue
        kwargs[name] = _convert(hints[name], table[name], source=source, key=key)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {where}: {e}") from e
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {where}: {e}") from e


def _dotted(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin is dict:
        return "a table"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "nothing"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            Path: "a path string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(tp: Any, value: Any, *, source: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{source}: {key} = {value!r} is not allowed (expected {_describe(tp)})")
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1:   # "X or nothing": X's own error says more (an unknown key inside a table)
            return _convert(arms[0], value, source=source, key=key)
        last: ConfigError = bad
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, source=source, key=key)
            except ConfigError as e:
                last = e
        raise bad from last
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise bad
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise bad
        (arg, *_rest) = typing.get_args(tp) or (Any,)
        items = [_convert(arg, v, source=source, key=f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        _key_type, vt = typing.get_args(tp) or (str, Any)
        return {k: _convert(vt, v, source=source, key=f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return load_dataclass(typing.cast(type, tp), value, source=source, prefix=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if tp is Path:
        if isinstance(value, str) and value:
            control = next((c for c in value if not c.isprintable()), None)
            if control is not None:
                # a newline in a path reaches a batch script's #SBATCH line or a log line as two
                raise ConfigError(f"{source}: {key} = {value!r} is not allowed (a path without control "
                                  f"characters; found {control!r})")
            return Path(value)
        raise bad
    raise bad
