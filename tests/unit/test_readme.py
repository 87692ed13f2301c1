"""README.md against what it describes: every built-in demo of the model family registry named wherever the
README lists demos, every measured figure dated and pointing at its measurement, every link into docs/
landing on a heading."""
from __future__ import annotations

import json
import re
from pathlib import Path

from modules.families.registry import BUILTIN_MODELS

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
DEMO_NAME = re.compile(r"#demo\w*")


def demo_presets() -> dict[str, str]:
    """`#demo...` preset name -> its `model.base_model`, for every demo preset in training_presets/."""
    found = {}
    for path in sorted((REPO / "training_presets").glob("#demo*.json")):
        found[path.stem] = json.loads(path.read_text(encoding="utf-8")).get("model", {}).get("base_model", "")
    return found


def test_every_built_in_demo_has_a_preset():
    presets = demo_presets()
    by_model = {model: name for name, model in presets.items()}
    assert set(BUILTIN_MODELS) <= set(by_model), \
        f"built-in models without a #demo preset: {sorted(set(BUILTIN_MODELS) - set(by_model))}"
    assert set(by_model) <= set(BUILTIN_MODELS), \
        f"#demo presets on no built-in model of the registry: { {n: m for n, m in presets.items() if m not in BUILTIN_MODELS} }"


def readme_demo_lists() -> list[tuple[int, set[str]]]:
    """(first line number, names) of each place the README lists demos: consecutive lines that name some,
    taken together, with at least three names (one name is a command's example, not a list)."""
    lists, current, start = [], set(), 0
    for number, line in enumerate(README.splitlines() + [""], 1):
        names = set(DEMO_NAME.findall(line))
        if names:
            start = start or number
            current |= names
            continue
        if len(current) >= 3:
            lists.append((start, current))
        current, start = set(), 0
    return lists


def test_the_readme_lists_every_built_in_demo_wherever_it_lists_demos():
    every = set(demo_presets())
    lists = readme_demo_lists()
    assert lists, "the README lists no demos"
    for line, names in lists:
        assert names == every, (f"README.md line {line} lists {sorted(names)}; the registry's demos are {sorted(every)}: "
                                f"missing {sorted(every - names)}, unknown {sorted(names - every)}")


FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:img/s|GiB\b|x\b|%|s\b|minutes\b)|\b\d+ of \d+ trials")
"""A measured figure: images per second, GiB, a speed-up, a share, seconds, minutes, trials."""
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
SOURCE = re.compile(r"docs/(Performance|MultiGPUTraining)\.md|run-tests\.sh")
SETTINGS = re.compile(r"`[^`]*`|\"[^\"]*\"|\be\.g\. [^;,)]*|held to \d+ GiB|of \d+ GiB|\d+ GiB each|\d+ x \d+")
"""Values a user types (settings, examples, cards) and quoted messages, not measurements."""


def readme_blocks() -> list[tuple[int, str]]:
    """The README's paragraphs and list items, with their first line numbers (code blocks and tables left out)."""
    blocks, lines, start, fenced = [], [], 0, False
    for number, line in enumerate(README.splitlines() + [""], 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("|") or line.startswith("#"):
            continue
        if not line.strip() or line.startswith("- "):
            if lines:
                blocks.append((start, " ".join(lines)))
            lines, start = ([line], number) if line.startswith("- ") else ([], 0)
            continue
        lines.append(line)
        start = start or number
    return blocks


def test_every_measured_figure_in_the_readme_has_a_date_and_a_source():
    """Checked per paragraph or list item (a heuristic: a figure's own date and pointer stand beside it)."""
    undated = []
    for line, text in readme_blocks():
        figures = FIGURE.findall(SETTINGS.sub("", text))
        if figures and not (DATE.search(text) and SOURCE.search(text)):
            undated.append(f"line {line}: {figures[:4]} with{'' if DATE.search(text) else 'out'} a date, "
                           f"with{'' if SOURCE.search(text) else 'out'} a pointer: {text[:120]}...")
    assert not undated, "README figures without a date or a pointer to their measurement:\n" + "\n".join(undated)


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces to hyphens)."""
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_link_into_the_docs_lands_on_a_heading():
    broken = []
    for target, anchor in re.findall(r"\]\((docs/[\w./-]+\.md)(?:#([\w-]+))?\)", README):
        path = REPO / target
        if not path.is_file():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in heading_anchors(path):
            broken.append(f"{target}#{anchor}: no such heading")
    assert not broken, "\n".join(broken)
