"""Dataclasses as JSON between processes: what one process writes, the other reads back into
the same types, refusing a field it does not know or of the wrong type by name, rather than
failing later on a value that crossed as a string."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """JSON that does not make the config asked for; the message names the field."""


def to_json(obj: Any) -> str:
    return json.dumps(dataclasses.asdict(obj), default=str)


def from_json(cls: type[T], text: str) -> T:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cls.__name__}: not JSON ({e})") from None
    return _value(cls, data, cls.__name__)


def _value(kind: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(kind):
        return _dataclass(kind, value, where)
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is not type(None):
                return _value(option, value, where)
    if typing.get_origin(kind) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {value!r}")
        key, item = typing.get_args(kind)
        return {_value(key, k, where): _value(item, v, f"{where}[{k!r}]")
                for k, v in value.items()}
    if typing.get_origin(kind) is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = typing.get_args(kind)[0]
        return tuple(_value(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if kind is Path:
        return Path(_value(str, value, where))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}")
    return value


def _dataclass(cls: type[T], data: Any, where: str) -> T:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := sorted(set(data) - set(fields)):
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
    hints = typing.get_type_hints(cls)
    missing = [name for name, f in fields.items() if name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
    return cls(**{name: _value(hints[name], value, f"{where}.{name}")
                  for name, value in data.items()})
