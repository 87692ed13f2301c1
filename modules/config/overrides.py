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
from typing import Any, Iterable

from .field_paths import BadSegment, NoSuchField, NotAList, NotASection, field_types, parse_path, walk_types
from .serialization import ConfigError, closest_name, config_from_dict, config_to_dict
from .train_config import REMOVED_FIELDS, TrainConfig

OVERRIDE_SOURCE = "--config-value"

EXAMPLE = "training.learning_rate=1e-4"


class _OverrideProblem(Exception):
    """One bad override; its message is the full sentence reported to the user."""


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
    try:
        _walk_and_set(data, key, text)
    except BadSegment as bad:
        raise _OverrideProblem(f"{key}: {bad.args[0]!r} is not a field name; write keys like "
                               "'training.batch_size' or 'data.concepts[0].path'.") from None
    except NotASection as e:
        raise _OverrideProblem(f"{key}: {e.walked or 'the config'} has no field {e.step!r} (it holds a value of "
                               f"type {getattr(e.annotation, '__name__', e.annotation)}, not a section).") from None
    except NoSuchField as e:
        if f"{e.walked}.{e.step}" in REMOVED_FIELDS:
            raise _OverrideProblem(f"{key}: no longer a config field; {REMOVED_FIELDS[f'{e.walked}.{e.step}']}.") from None
        names = list(field_types(e.annotation))
        near = closest_name(e.step, names)
        hint = f" Did you mean '{near}'?" if near else ""
        prefix = f"{e.walked}." if e.walked else ""
        raise _OverrideProblem(f"{key}: {e.walked or 'the top level'} has no field {e.step!r}.{hint} "
                               f"Valid keys: {', '.join(prefix + n for n in names)}.") from None
    except NotAList as e:
        raise _OverrideProblem(f"{key}: {e.walked} is not a list, so [{e.step}] cannot index it.") from None


def _walk_and_set(data: dict, key: str, text: str) -> None:
    container: Any = data
    last = len(parse_path(key)) - 1
    for position, (step, annotation, walked) in enumerate(walk_types(key)):
        if isinstance(step, int):
            if step == len(container):
                # One past the end appends a fresh entry, so a concept can be added from the CLI.
                container.append(_default_item(annotation))
            elif step > len(container):
                raise _OverrideProblem(f"{key}: index {step} is out of range; {walked} has "
                                       f"{len(container)} item(s): use 0..{len(container) - 1}, "
                                       f"or {len(container)} to add one.")
        if position == last:
            container[step] = _parse_value(text, annotation)
        else:
            container = container[step]


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
