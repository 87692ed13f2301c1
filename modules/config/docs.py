"""Field documentation read from the source of the config dataclasses.

Each field of a config dataclass has a string literal directly beneath it. Python discards those
strings at run time, so they are read back from the source with `ast`. The GUI shows them as
tooltips and `docs/Configuration.md` is checked against them.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap

from .field_paths import field_types, item_type
from .train_config import TrainConfig


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """`{field name: docstring}` for the dataclass `cls`, in declaration order.

    A field without a docstring is missing from the result (a test keeps that from happening).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"field_docs expects a dataclass, got {cls!r}")
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    class_def = next(node for node in tree.body if isinstance(node, ast.ClassDef))
    docs: dict[str, str] = {}
    body = class_def.body
    for node, following in zip(body, body[1:]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def section_classes(cls: type = TrainConfig, prefix: str = "") -> dict[str, type]:
    """Every dataclass reachable from `cls`, keyed by its path: `""` for the root, `"training"`,
    and `"data.concepts[]"` for the items of a list of sections."""
    found = {prefix: cls}
    for name, tp in field_types(cls).items():
        path = f"{prefix}.{name}" if prefix else name
        if item_type(tp) is not None:
            tp = item_type(tp)
            path += "[]"
        if dataclasses.is_dataclass(tp):
            found.update(section_classes(tp, path))
    return found
