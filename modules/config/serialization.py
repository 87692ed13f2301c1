"""Strict conversion between `TrainConfig` and plain JSON data.

Every problem found while reading is collected and raised together in one `ConfigError`, so that a
user fixes a file in one go instead of one run per mistake.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing
from pathlib import Path
from typing import Any

from modules.util.atomic import write_text_atomically

from .errors import ConfigError
from .migrations import VERSION_KEY, migrate
from .train_config import CONFIG_VERSION, REMOVED_FIELDS, TrainConfig

_TYPE_FIXES = {
    bool: "write true or false",
    int: "write a whole number such as 4",
    float: "write a number such as 0.0001 or 1e-4",
    str: 'write text in quotes, such as "value"',
}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str, problems: list[str]) -> Any:
    """Check `value` against the annotation `tp` and convert it; record a problem on mismatch."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected an object (section), got {value!r}.")
            return tp()
        return _dataclass_from_dict(tp, value, path, problems)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {value!r}.")
            return []
        return [_convert(v, item_tp, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a new annotation kind needs handling here
        raise TypeError(f"unsupported config annotation {tp!r} at {path}")
    problems.append(f"{path}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__}); "
                    f"{_TYPE_FIXES[tp]}.")
    return None


def closest_name(key: str, names: list[str]) -> str | None:
    """The name in `names` that `key` most likely misspells (`batch_sise`, `BatchSize`), or None."""
    squashed = {n.lower().replace("_", ""): n for n in names}
    near = squashed.get(str(key).lower().replace("_", ""))
    if near is None:
        close = difflib.get_close_matches(str(key).lower(), names, n=1, cutoff=0.75)
        near = close[0] if close else None
    return near


def unknown_key_hint(key: str, names: list[str]) -> str:
    """' Did you mean ...?' for a near miss, else the list of valid names."""
    near = closest_name(key, names)
    if near is not None:
        return f" Did you mean '{near}'?"
    return f" Valid fields here: {', '.join(names)}."


def _dataclass_from_dict(cls: type, data: dict, path: str, problems: list[str]):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else key
        if key not in names:
            if key_path in REMOVED_FIELDS:
                problems.append(f"{key_path}: no longer a config field; {REMOVED_FIELDS[key_path]}.")
            else:
                problems.append(f"{key_path}: unknown field.{unknown_key_hint(key, names)}")
            continue
        converted = _convert(value, hints[key], key_path, problems)
        if converted is not None:
            kwargs[key] = converted
    return cls(**kwargs)


def config_from_dict(data: dict, source: str | None = None) -> TrainConfig:
    """Build a `TrainConfig` from JSON data of any known version; missing fields take defaults."""
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a JSON object, got {type(data).__name__}."], source)
    data = migrate(dict(data), source)
    data.pop(VERSION_KEY, None)
    problems: list[str] = []
    cfg = _dataclass_from_dict(TrainConfig, data, "", problems)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def config_to_dict(cfg: TrainConfig) -> dict:
    """Plain JSON data for `cfg`, `__version` first."""
    return {VERSION_KEY: CONFIG_VERSION, **dataclasses.asdict(cfg)}


def read_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"config file not found: {path}. Check the path or pick a preset."], str(path)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError([f"not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}."], str(path)) from None


def save_config(cfg: TrainConfig, path: str | os.PathLike, follow_link: bool = False) -> None:
    """Write `cfg` as JSON atomically: a crash mid-write never leaves a truncated config. A `path` that is a
    symbolic link is refused (a workspace's files) unless `follow_link` (a file the user chose: its target)."""
    write_text_atomically(path, json.dumps(config_to_dict(cfg), indent=2) + "\n", follow_link=follow_link)
