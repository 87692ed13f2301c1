"""Field paths into a `TrainConfig`, parsed and walked in one place.

A path names a field the way validation messages do: `training.batch_size`, `data.concepts[0].repeats`,
`sampling.prompts[2].prompt`. `--config-value` overrides (`overrides.py`) walk the config's JSON data
with it, the GUI (`ui/binding.py`) walks the config object; both step through the dataclasses' type
annotations here, so a path means the same thing everywhere. (Reading a file, `serialization.py`,
converts the whole tree at once and needs no paths.)
"""
from __future__ import annotations

import dataclasses
import functools
import re
import typing
from typing import Any, Iterator

from .train_config import TrainConfig

_SEGMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)$")
_INDEX = re.compile(r"\[(\d+)\]")

Step = typing.Union[str, int]


class BadSegment(ValueError):
    """A part of a path that is no field name (`args[0]` is the part)."""


def parse_path(path: str) -> list[Step]:
    """`data.concepts[0].repeats` -> `["data", "concepts", 0, "repeats"]`; raises `BadSegment`."""
    steps: list[Step] = []
    for segment in path.split("."):
        match = _SEGMENT.match(segment.strip())
        if not match:
            raise BadSegment(segment)
        steps.append(match.group(1))
        steps.extend(int(i) for i in _INDEX.findall(match.group(2)))
    return steps


def join_path(steps: list[Step]) -> str:
    """The inverse of `parse_path`."""
    text = ""
    for step in steps:
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else step)
    return text


@functools.lru_cache(maxsize=None)
def field_types(section: type) -> dict[str, Any]:
    """A dataclass's fields and their annotations, in declaration order."""
    hints = typing.get_type_hints(section)
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def item_type(annotation: Any) -> Any | None:
    """The item annotation of a `list[...]` annotation; None for anything else."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else None


class PathDoesNotFit(KeyError):
    """A step of a path that the annotations do not allow; `walked` is the path up to it."""

    def __init__(self, walked: str, step: Step, annotation: Any) -> None:
        super().__init__(walked, step)
        self.walked, self.step, self.annotation = walked, step, annotation


class NoSuchField(PathDoesNotFit):
    """`step` is no field of the section `annotation`."""


class NotASection(PathDoesNotFit):
    """A field name after a value that is not a section."""


class NotAList(PathDoesNotFit):
    """An index after a value that is not a list."""


def walk_types(path: str, root: type = TrainConfig) -> Iterator[tuple[Step, Any, str]]:
    """Each step of `path` with the annotation it reaches and the path walked before it, checked
    against the annotations (raises `BadSegment` or a `PathDoesNotFit`)."""
    annotation: Any = root
    walked: list[Step] = []
    for step in parse_path(path):
        before = join_path(walked)
        if isinstance(step, str):
            if not dataclasses.is_dataclass(annotation):
                raise NotASection(before, step, annotation)
            fields = field_types(annotation)
            if step not in fields:
                raise NoSuchField(before, step, annotation)
            annotation = fields[step]
        else:
            item = item_type(annotation)
            if item is None:
                raise NotAList(before, step, annotation)
            annotation = item
        walked.append(step)
        yield step, annotation, before


def leaf_paths(cfg: Any) -> list[str]:
    """Every leaf field path of a config object, list items of sections included."""
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
