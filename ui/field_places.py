"""Where each field is in the window, so that messages name the tab and label instead of a config path.

Validation messages name fields by path (`training.batch_size: 0 is not allowed ...`), which is what the
command line and config files need. In the window, "Training › Batch size per GPU: 0 is not allowed ..."
is what a user can find. The views register each field's place as they build it; list rows register
one template per column (`data.concepts[].repeats`), numbered by row when used.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# A field path inside a sentence: words joined by dots, list items in brackets.
_PATH = re.compile(r"\b[a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)+\b")
_INDEX = re.compile(r"\[(\d+)\]")
_BACKTICKED_NAME = re.compile(r"`([a-z_][a-z0-9_]*)`")
SEPARATOR = " › "


@dataclass
class FieldPlaces:
    places: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Path (list items as `[]`) -> (tab, label)."""

    def add(self, path: str, tab: str, label: str) -> None:
        self.places[_INDEX.sub("[]", path)] = (tab, label)

    def name(self, path: str) -> str | None:
        """`Training › Batch size per GPU`, `Data › Concepts, row 2 › Repeats`; None for an unplaced path."""
        template = _INDEX.sub("[]", path)
        if template not in self.places:
            return None
        tab, label = self.places[template]
        rows = [int(i) + 1 for i in _INDEX.findall(path)]
        if rows:
            owner = self.places.get(template.rsplit("[]", 1)[0])
            owner_label = owner[1] if owner else template.split("[]")[0].rsplit(".", 1)[-1].capitalize()
            if owner_label != label:
                return SEPARATOR.join((tab, f"{owner_label}, row {rows[-1]}", label))
            return SEPARATOR.join((tab, f"{label}, row {rows[-1]}"))
        return SEPARATOR.join((tab, label))

    def describe(self, message: str) -> str:
        """`message` with every placed field path replaced by its tab and label."""
        return _PATH.sub(lambda m: self.name(m.group(0)) or m.group(0), message)

    def describe_doc(self, doc: str, path: str) -> str:
        """A field's docstring for its tooltip: the fields it names by path or, in backticks, by the bare name
        of a field beside it (`nnodes` in multi_gpu's docs) replaced by their tab and label."""
        section = path.rsplit(".", 1)[0] if "." in path else ""

        def sibling(match: re.Match) -> str:
            return self.name(f"{section}.{match.group(1)}") or match.group(0)

        return self.describe(_BACKTICKED_NAME.sub(sibling, doc) if section else doc)

    def without_field(self, message: str, path: str) -> str:
        """A message shown under its own field: its leading `path: ` dropped, other paths described."""
        prefix = f"{path}: "
        return self.describe(message[len(prefix):] if message.startswith(prefix) else message)
