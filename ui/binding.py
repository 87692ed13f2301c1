"""Field paths into a `TrainConfig`: read, write with type conversion, and look up the tooltip.

A path names one leaf field the way validation messages do: `training.batch_size`,
`data.concepts[0].repeats`, `sampling.prompts[2].prompt`. Views hold only text or bools and go
through here, so the rules for turning "1e-4" into a float live in one place and are tested
without a display.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from modules.config import TrainConfig
from modules.config.docs import field_docs

_PART = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[(\d+)\])?$")


class FieldError(ValueError):
    """A value that cannot be stored in a field; the message is shown beside the field."""


def _parts(path: str) -> list[tuple[str, int | None]]:
    parts = []
    for piece in path.split("."):
        match = _PART.match(piece)
        if not match:
            raise KeyError(f"{path!r} is not a field path (expected names like training.batch_size)")
        parts.append((match.group(1), int(match.group(2)) if match.group(2) is not None else None))
    return parts


def _walk(cfg: Any, path: str) -> tuple[Any, str, Any]:
    """The object that owns the last field of `path`, the field's name and its annotation."""
    owner: Any = cfg
    parts = _parts(path)
    for i, (name, index) in enumerate(parts):
        hints = typing.get_type_hints(type(owner))
        if name not in hints:
            raise KeyError(f"{path!r}: {type(owner).__name__} has no field {name!r}")
        if i == len(parts) - 1:
            if index is not None:
                raise KeyError(f"{path!r}: a path must end at a field, not a list item")
            return owner, name, hints[name]
        owner = getattr(owner, name)
        if index is not None:
            if not isinstance(owner, list) or index >= len(owner):
                raise KeyError(f"{path!r}: there is no item {index} in {name}")
            owner = owner[index]
    raise KeyError(f"{path!r} is empty")


def field_type(path: str, cfg: TrainConfig | None = None) -> Any:
    """The annotation of the field at `path` (`int`, `str`, `list[str]`, ...)."""
    return _walk(cfg if cfg is not None else _sample_config(path), path)[2]


def _sample_config(path: str) -> TrainConfig:
    # Item paths like data.concepts[3] need an item to walk through; build enough of them.
    cfg = TrainConfig()
    for name, index in _parts(path):
        if index is not None and name == "concepts":
            cfg.data.concepts = [type(cfg.data.concepts[0])() for _ in range(index + 1)]
        if index is not None and name == "prompts":
            from modules.config import SamplePromptConfig
            cfg.sampling.prompts = [SamplePromptConfig() for _ in range(index + 1)]
    return cfg


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
    owner, name, _ = _walk(_sample_config(path), path)
    return field_docs(type(owner)).get(name, "")


def plain_text(doc: str) -> str:
    """Docstring text as a tooltip shows it: the backticks that mark code in the docs removed."""
    return doc.replace("`", "")


def field_label(path: str) -> str:
    """`training.lora_rank` -> `Lora rank`: a readable label derived from the field name."""
    name = _parts(path)[-1][0]
    words = name.replace("_", " ")
    return words[0].upper() + words[1:]


def leaf_paths(cfg: TrainConfig) -> list[str]:
    """Every leaf field path of `cfg`, list items included (used to refresh all widgets)."""
    paths: list[str] = []

    def visit(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            path = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(value):
                visit(value, path)
            elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
                for i, item in enumerate(value):
                    visit(item, f"{path}[{i}]")
            else:
                paths.append(path)

    visit(cfg, "")
    return paths
