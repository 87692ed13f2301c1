"""The samples of a workspace as the Run tab's gallery shows them: per run, every sampling, every prompt.

The trainer writes each sampling's images to `samples/<run id>/step-<step>-<prompt>.png`, a video family's clips
to `.webp` files of the same names (files directly in `samples/` are from before run folders). The prompts' text comes from the run's own events while it runs,
else from the config the run wrote at its start (`config/<run id>*.json`). No Tk in here.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

SAMPLE_FILE = re.compile(r"^step-(\d+)-(\d+)\.(?:png|webp)$")
EARLIER = "(earlier runs)"
"""The run name of samples written directly into `samples/`, before each run had a folder."""


@dataclass(frozen=True)
class Sample:
    path: Path
    step: int
    prompt_index: int
    prompt: str


@dataclass(frozen=True)
class Sampling:
    """One sampling of a run: the images of every prompt at one step, in prompt order."""
    step: int
    samples: tuple[Sample, ...]


def sample_runs(samples_dir: Path) -> list[str]:
    """The runs with samples, newest first (run ids sort by their start time); EARLIER last."""
    samples_dir = Path(samples_dir)
    if not samples_dir.is_dir():
        return []
    runs = sorted((p.name for p in samples_dir.iterdir()
                   if p.is_dir() and any(SAMPLE_FILE.match(f.name) for f in p.iterdir())), reverse=True)
    if any(SAMPLE_FILE.match(p.name) for p in samples_dir.iterdir() if p.is_file()):
        runs.append(EARLIER)
    return runs


def run_folder(samples_dir: Path, run: str) -> Path:
    return Path(samples_dir) if run == EARLIER else Path(samples_dir) / run


def run_prompts(workspace: Path, run: str) -> dict[int, str]:
    """The prompts of `run` as its config at start recorded them (the newest of a resumed run's), else {}."""
    configs = sorted(Path(workspace, "config").glob(f"{run}*.json"), key=lambda p: p.stat().st_mtime)
    for path in reversed(configs):
        try:
            prompts = json.loads(path.read_text(encoding="utf-8"))["sampling"]["prompts"]
            return {i: str(p.get("prompt", "")) for i, p in enumerate(prompts)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return {}


def samplings(folder: Path, prompts: dict[int, str] | None = None) -> list[Sampling]:
    """Every sampling in a run's folder, oldest first; `prompts` gives the text of each prompt index."""
    prompts = prompts or {}
    by_step: dict[int, list[Sample]] = {}
    folder = Path(folder)
    if folder.is_dir():
        for path in folder.iterdir():
            match = SAMPLE_FILE.match(path.name)
            if match and path.is_file():
                step, index = int(match.group(1)), int(match.group(2))
                by_step.setdefault(step, []).append(
                    Sample(path, step, index, prompts.get(index) or f"prompt {index + 1}"))
    return [Sampling(step, tuple(sorted(found, key=lambda s: s.prompt_index)))
            for step, found in sorted(by_step.items())]


def run_of_sample(path: str | Path, samples_dir: Path) -> str:
    """The run a sample file belongs to (its folder's name), or EARLIER."""
    parent = Path(path).parent
    return EARLIER if parent.resolve() == Path(samples_dir).resolve() else parent.name
