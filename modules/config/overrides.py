"""`KEY=VALUE` overrides (`--config-value` on the command line) applied to a `TrainConfig`.

A key is a dotted field path with list indexes: `training.learning_rate`, `data.concepts[0].repeats`.
A value is read as JSON when it parses (`true`, `3`, `1e-4`, `["to_q"]`, `{"path": "x"}`), else taken
as a plain string, so `general.device=cpu` needs no quotes. For text fields the raw text is kept
whatever it looks like: `multi_gpu.device_indexes=0,1` and `save.output_name=123` both stay strings.
The result goes through the same strict typing as a config file.
"""
from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Any, Iterable

from .serialization import ConfigError, closest_name, config_from_dict, config_to_dict
from .train_config import REMOVED_FIELDS, TrainConfig

OVERRIDE_SOURCE = "--config-value"

_SEGMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)$")
_INDEX = re.compile(r"\[(\d+)\]")

EXAMPLE = "training.learning_rate=1e-4"


class _OverrideProblem(Exception):
    """One bad override; its message is the full sentence reported to the user."""


def _parse_key(key: str) -> list[str | int]:
    """`data.concepts[0].repeats` -> `["data", "concepts", 0, "repeats"]`."""
    steps: list[str | int] = []
    for segment in key.split("."):
        match = _SEGMENT.match(segment.strip())
        if not match:
            raise _OverrideProblem(f"{key}: {segment!r} is not a field name; write keys like "
                                   "'training.batch_size' or 'data.concepts[0].path'.")
        steps.append(match.group(1))
        steps.extend(int(i) for i in _INDEX.findall(match.group(2)))
    return steps


def _parse_value(text: str, field_type: Any) -> Any:
    if field_type is str:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _default_item(item_type: Any) -> Any:
    """The JSON data of a new list entry (for `data.concepts[<len>].path=...`)."""
    return dataclasses.asdict(item_type()) if dataclasses.is_dataclass(item_type) else None


def _set(data: dict, key: str, text: str) -> None:
    """Set `key` in the config JSON `data` to the parsed `text`, checking the path against the types."""
    steps = _parse_key(key)
    container: Any = data
    tp: Any = TrainConfig
    walked = ""
    for position, step in enumerate(steps):
        last = position == len(steps) - 1
        if isinstance(step, str):
            if not dataclasses.is_dataclass(tp):
                raise _OverrideProblem(f"{key}: {walked or 'the config'} has no field {step!r} "
                                       f"(it holds a value of type {getattr(tp, '__name__', tp)}, not a section).")
            hints = typing.get_type_hints(tp)
            if step not in hints:
                if f"{walked}.{step}" in REMOVED_FIELDS:
                    raise _OverrideProblem(f"{key}: no longer a config field; {REMOVED_FIELDS[f'{walked}.{step}']}.")
                names = [f.name for f in dataclasses.fields(tp)]
                near = closest_name(step, names)
                hint = f" Did you mean '{near}'?" if near else ""
                prefix = f"{walked}." if walked else ""
                raise _OverrideProblem(f"{key}: {walked or 'the top level'} has no field {step!r}.{hint} "
                                       f"Valid keys: {', '.join(prefix + n for n in names)}.")
            tp = hints[step]
        else:
            if typing.get_origin(tp) is not list:
                raise _OverrideProblem(f"{key}: {walked} is not a list, so [{step}] cannot index it.")
            (tp,) = typing.get_args(tp)
            if step == len(container):
                # One past the end appends a fresh entry, so a concept can be added from the CLI.
                container.append(_default_item(tp))
            elif step > len(container):
                raise _OverrideProblem(f"{key}: index {step} is out of range; {walked} has "
                                       f"{len(container)} item(s): use 0..{len(container) - 1}, "
                                       f"or {len(container)} to add one.")
        if last:
            container[step] = _parse_value(text, tp)
        else:
            container = container[step]
        walked += f"[{step}]" if isinstance(step, int) else (f".{step}" if walked else step)


def apply_overrides(cfg: TrainConfig, overrides: Iterable[str],
                    source: str = OVERRIDE_SOURCE) -> TrainConfig:
    """A new `TrainConfig`: `cfg` with every `KEY=VALUE` of `overrides` applied; `cfg` is unchanged.

    Raises `ConfigError` listing every bad override (malformed, unknown key, wrong type) at once.
    """
    data = config_to_dict(cfg)
    problems: list[str] = []
    for override in overrides:
        key, sep, text = str(override).partition("=")
        if not sep or not key.strip():
            problems.append(f"{override!r}: expected KEY=VALUE, for example {EXAMPLE}.")
            continue
        try:
            _set(data, key.strip(), text)
        except _OverrideProblem as problem:
            problems.append(str(problem))
    try:
        # Strict typing of the whole result: names `training.batch_size` for `batch_size=abc`.
        cfg = config_from_dict(data, source)
    except ConfigError as error:
        problems += error.problems
    if problems:
        raise ConfigError(problems, source)
    return cfg
