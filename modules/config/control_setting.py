"""What `data.concepts[].control` names: control folders beside the images, or a JSON Lines manifest.

The rule is read here, torch-free, by validation (a folder or manifest that is not there) and by the data scan
(`modules/data/controls.py`), so both read the setting the same way.
"""
from __future__ import annotations

from pathlib import Path

MANIFEST_SUFFIX = ".jsonl"
"""A `control` setting ending so is a manifest; anything else names folders."""


def is_manifest(setting: str) -> bool:
    return setting.strip().lower().endswith(MANIFEST_SUFFIX)


def control_folders(concept_folder: Path, setting: str) -> list[Path]:
    """The control folders a setting names (`control`, or `control_1, control_2`), resolved against the concept
    folder."""
    names = [part.strip() for part in setting.split(",") if part.strip()]
    return [resolved(concept_folder, name) for name in names]


def manifest_path(concept_folder: Path, setting: str) -> Path:
    return resolved(concept_folder, setting.strip())


def resolved(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def setting_problem(concept_folder: Path, setting: str, field: str) -> str | None:
    """Why `setting` names no pairs to read (a missing folder or manifest), with its fix; None if it names some."""
    if not setting.strip():
        return None
    if is_manifest(setting):
        path = manifest_path(concept_folder, setting)
        return None if path.is_file() else (
            f"{field}: the manifest {setting!r} does not exist (looked for {path}); write one JSON object per line "
            "there, or name the control folder instead.")
    for folder in control_folders(concept_folder, setting):
        if not folder.is_dir():
            return (f"{field}: the control folder {folder} does not exist; put the control images in a folder beside "
                    "the images (same file names), or fix the setting (folders separated by commas).")
    return None


def controls_per_image(concepts) -> int:
    """Control images per image the enabled concepts name: their folders, or 1 for a manifest (whose lines hold
    their count; the scan requires every image to have as many)."""
    counts = [1 if is_manifest(c.control) else len([p for p in c.control.split(",") if p.strip()])
              for c in concepts if c.enabled and c.control.strip()]
    return max(counts, default=0)
