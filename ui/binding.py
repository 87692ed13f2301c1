"""Field paths into a `TrainConfig`: read, write with type conversion, and look up the tooltip.

A path names one leaf field the way validation messages do: `training.batch_size`,
`data.concepts[0].repeats`, `sampling.prompts[2].prompt`. Views hold only text or bools and go
through here, so the rules for turning "1e-4" into a float live in one place and are tested
without a display.
"""
from __future__ import annotations

import typing
from typing import Any

from modules.config import TrainConfig
from modules.config.docs import field_docs
from modules.config.field_labels import field_label as config_field_label
from modules.config.field_paths import BadSegment, PathDoesNotFit, Step, walk_types
from modules.config.field_rules import rules_of

class FieldError(ValueError):
    """A value that cannot be stored in a field; the message is shown beside the field."""


def _steps(path: str) -> list[tuple[Step, Any, str]]:
    """The steps of `path` (modules/config/field_paths.walk_types), as KeyErrors the views show."""
    try:
        steps = list(walk_types(path))
    except BadSegment:
        raise KeyError(f"{path!r} is not a field path (expected names like training.batch_size)") from None
    except PathDoesNotFit as e:
        owner = getattr(e.annotation, "__name__", e.annotation)
        raise KeyError(f"{path!r}: {owner} has no field {e.step!r}") from None
    if not steps:
        raise KeyError(f"{path!r} is empty")
    if isinstance(steps[-1][0], int):
        raise KeyError(f"{path!r}: a path must end at a field, not a list item")
    return steps


def _walk(cfg: Any, path: str) -> tuple[Any, str, Any]:
    """The object that owns the last field of `path`, the field's name and its annotation."""
    steps = _steps(path)
    owner: Any = cfg
    for step, _, walked in steps[:-1]:
        if isinstance(step, int):
            if not isinstance(owner, list) or step >= len(owner):
                raise KeyError(f"{path!r}: there is no item {step} in {walked.rpartition('.')[2]}")
            owner = owner[step]
        else:
            owner = getattr(owner, step)
    name, annotation, _ = steps[-1]
    return owner, name, annotation


def field_type(path: str) -> Any:
    """The annotation of the field at `path` (`int`, `str`, `list[str]`, ...)."""
    return _steps(path)[-1][1]


def get_value(cfg: TrainConfig, path: str) -> Any:
    owner, name, _ = _walk(cfg, path)
    return getattr(owner, name)


def set_value(cfg: TrainConfig, path: str, value: Any) -> Any:
    """Convert `value` (typed or text from an entry) to the field's type and store it.

    Returns the stored value; raises `FieldError` with a user-facing reason and leaves the
    config unchanged when the value does not fit the field's type.
    """
    owner, name, tp = _walk(cfg, path)
    converted = convert(value, tp)
    setattr(owner, name, converted)
    return converted


def convert(value: Any, tp: Any) -> Any:
    if typing.get_origin(tp) is list:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        if isinstance(value, (list, tuple)):
            return [convert(item, typing.get_args(tp)[0]) for item in value]
        raise FieldError(f"expected a comma-separated list, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int,)) and value in (0, 1):
            return bool(value)
        text = str(value).strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True
        if text in ("false", "no", "off", "0"):
            return False
        raise FieldError(f"expected on or off, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise FieldError(f"expected a whole number, got {value!r}")
        if isinstance(value, int):
            return value
        text = str(value).strip()
        try:
            return int(text)
        except ValueError:
            try:
                as_float = float(text)
            except ValueError:
                raise FieldError(f"expected a whole number such as 4, got {text!r}") from None
            if as_float.is_integer():
                return int(as_float)
            raise FieldError(f"expected a whole number such as 4, got {text!r}") from None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        text = str(value).strip()
        try:
            return float(text)
        except ValueError:
            raise FieldError(f"expected a number such as 0.0001 or 1e-4, got {text!r}") from None
    if tp is str:
        return value if isinstance(value, str) else str(value)
    raise FieldError(f"fields of type {tp!r} cannot be edited here")


def format_value(value: Any) -> str:
    """Text for an entry: lists comma-separated, floats without needless digits."""
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back as the same float
    return str(value)


def field_doc(path: str) -> str:
    """The field's docstring from `TrainConfig` (the one source of tooltip text)."""
    steps = _steps(path)
    section = steps[-2][1] if len(steps) > 1 else TrainConfig
    return field_docs(section).get(steps[-1][0], "")


def plain_text(doc: str) -> str:
    """Docstring text as a tooltip shows it: the backticks that mark code in the docs removed."""
    return doc.replace("`", "")


def field_choices(path: str) -> tuple[str, ...]:
    """The values the field accepts as it declares them (`rule(..., choices=...)`); empty: any of its type.
    List items' fields too: `data.concepts[0].role`."""
    steps = _steps(path)
    section = steps[-2][1] if len(steps) > 1 else TrainConfig
    declared = rules_of(section).get(steps[-1][0])
    return declared.choices if declared is not None else ()


def field_label(path: str) -> str:
    """The label the field declares (`rule(..., label=...)` in train_config.py), else one made from its
    name: `training.seed` -> `Seed` (`modules/config/field_labels.py`: messages made outside the window use
    the same words)."""
    _steps(path)  # a path that is no field: the KeyError the views show
    return config_field_label(path)
