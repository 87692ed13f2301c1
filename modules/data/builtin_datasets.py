"""Where a concept's folder is: a folder on disk, or one of the built-in datasets, generated on first use."""
from __future__ import annotations

from pathlib import Path

from .demo_clips import DEMO_CLIPS_SCHEME, ensure_demo_clips
from .demo_dataset import DEMO_SCHEME, ensure_demo_dataset
from .demo_pairs import DEMO_PAIRS_SCHEME, ensure_demo_pairs

BUILTIN_DATASETS = {DEMO_SCHEME: ensure_demo_dataset, DEMO_CLIPS_SCHEME: ensure_demo_clips,
                    DEMO_PAIRS_SCHEME: ensure_demo_pairs}
"""`builtin:` concept paths -> what generates their folder: the demo's shapes (images), its clips and its edit pairs
(shapes recoloured, for edit models)."""


def resolve_concept_path(path: str) -> Path:
    """A concept's folder: a built-in dataset's name becomes its generated folder."""
    if path in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[path]()
    if path.startswith("builtin:"):
        raise ValueError(f"Unknown built-in dataset {path!r}; the built-in ones are "
                         f"{', '.join(map(repr, BUILTIN_DATASETS))}.")
    if not path:
        raise ValueError("A concept has an empty path; set data.concepts[].path to an image folder.")
    return Path(path).expanduser()


def resolve_file_path(path: str) -> Path:
    """A file path, or one inside a built-in dataset (`builtin:demo-shapes-edit/control/000.png`: generated first)."""
    path = path.strip()
    for scheme in BUILTIN_DATASETS:
        if path.startswith(scheme + "/"):
            return resolve_concept_path(scheme) / path[len(scheme) + 1:]
    return Path(path).expanduser()
