"""docs/Configuration.md stays in step with the dataclasses: every field, its default, its options."""
import dataclasses
import json
import re
from pathlib import Path

import pytest

from modules.config import TrainConfig, field_docs, list_presets, section_classes
from modules.config.field_rules import rules_of

DOC = Path(__file__).resolve().parents[2] / "docs" / "Configuration.md"
SECTIONS = {path: cls for path, cls in section_classes(TrainConfig).items() if path}
DECLARED_CHOICES = {(path, name): field_rule.choices for path, cls in SECTIONS.items()
                    for name, field_rule in rules_of(cls).items() if field_rule.choices}
"""Every field's declared choices, list items' (`data.concepts[]`) included: a superset of validation.CHOICES."""


def section_text(path: str) -> str:
    """The part of the doc from the heading of section `path` to the next heading."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(rf"^### `{re.escape(path)}`\n(.*?)(?=^#|\Z)", text, re.S | re.M)
    assert match, f"docs/Configuration.md has no '### `{path}`' heading"
    return match.group(1)


def table_rows(path: str) -> dict[str, list[str]]:
    rows = {}
    for line in section_text(path).splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


@pytest.mark.parametrize("path", sorted(SECTIONS))
def test_every_field_is_documented_with_its_default(path):
    cls = SECTIONS[path]
    rows = table_rows(path)
    defaults = cls()
    for f in dataclasses.fields(cls):
        assert f.name in rows, f"docs/Configuration.md: `{path}` table lacks `{f.name}`"
        value = getattr(defaults, f.name)
        scalar = not (isinstance(value, list) and value and dataclasses.is_dataclass(value[0]))
        if scalar:
            assert rows[f.name][0] == f"`{json.dumps(value)}`", f"stale default for {path}.{f.name}"
    assert set(rows) == {f.name for f in dataclasses.fields(cls)}, f"`{path}` documents removed fields"


@pytest.mark.parametrize("section, name", sorted(DECLARED_CHOICES))
def test_tooltips_list_every_accepted_option(section, name):
    doc = field_docs(SECTIONS[section])[name]
    missing = [choice for choice in DECLARED_CHOICES[(section, name)] if choice not in doc]
    assert not missing, f"{section}.{name}: its docstring does not mention {missing}"


MEASUREMENT = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b[AHB]\d00\b|\bRTX\b|img/s|images/s")
"""What a dated benchmark result carries: a date, a card, a throughput."""
FILE_PATH = re.compile(r"docs/|\.md\b")
"""A path into the repository, which a window user cannot follow: a tooltip names the page of the documentation."""


@pytest.mark.parametrize("path", sorted(SECTIONS))
def test_tooltips_point_at_the_figures_instead_of_carrying_them(path):
    """A docstring is a tooltip: what the setting does and when to use it. Measurements age and belong in
    docs/Performance.md, with their card, date and command; the tooltip names that page in words (this file's
    table links it)."""
    docs = field_docs(SECTIONS[path])
    dated = {name: MEASUREMENT.findall(doc) for name, doc in docs.items() if MEASUREMENT.search(doc)}
    assert not dated, f"{path}: docstrings with measurements (move them to docs/Performance.md and link it): {dated}"
    paths = {name: FILE_PATH.findall(doc) for name, doc in docs.items() if FILE_PATH.search(doc)}
    assert not paths, f"{path}: docstrings with file paths (say 'the Performance page of the documentation'): {paths}"


def test_every_preset_is_described():
    text = DOC.read_text(encoding="utf-8")
    for name in list_presets():
        assert f"| `{name}` |" in text, f"preset {name} is missing from the presets table"


def test_the_doc_covers_versions_overrides_and_validation():
    text = DOC.read_text(encoding="utf-8")
    for topic in ("__version", "MIGRATIONS", "--config-value", "check_paths=False", "sparse overlay",
                  "data.concepts[0].repeats=3", "builtin:"):
        assert topic in text
