"""What a config field accepts and how the GUI names it, declared with the field.

A field of `TrainConfig` that has rules is declared with `rule(default, choices=..., minimum=...,
above=..., label=...)` in train_config.py, beside its type and its docstring. Everything else reads
them from there: validation (`validation.CHOICES`, `MINIMUMS`, `ABOVE` are views of these rules),
the GUI (a drop-down for choices, the row's label), and the docs test (every choice in the field's
docstring, which is its tooltip).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

RULE = "tandem_rule"
"""The key of a field's `FieldRule` in its dataclass metadata."""


@dataclass(frozen=True)
class FieldRule:
    choices: tuple[str, ...] = ()
    """The accepted values (a drop-down in the GUI); empty: any value of the type."""
    minimum: int | float | None = None
    """The smallest accepted value (inclusive)."""
    above: float | None = None
    """Accepted values are strictly greater than this."""
    label: str = ""
    """The GUI's label of the field; empty: made from its name (`lora_rank` -> `Lora rank`)."""


def rule(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None,
         choices: tuple[str, ...] = (), minimum: int | float | None = None, above: float | None = None,
         label: str = "") -> Any:
    """A dataclass field with `default` (or a `factory` of it, for lists) and these rules (`FieldRule`)."""
    metadata = {RULE: FieldRule(tuple(choices), minimum, above, label)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def rules_of(section: type) -> dict[str, FieldRule]:
    """The rules of a section's fields that have any."""
    return {f.name: f.metadata[RULE] for f in dataclasses.fields(section) if RULE in f.metadata}
