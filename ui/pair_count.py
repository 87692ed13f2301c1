"""The Data tab's count of training pairs (edit models): how many of each concept's images have their control
images, and how many do not - before anything is read or loaded, so that a wrong folder shows while it is set.

Tk-free: it lists files only (the run reads and checks each image; `modules/data/concepts.py`)."""
from __future__ import annotations

from pathlib import Path

from modules.config import TrainConfig
from modules.config.control_setting import is_manifest, manifest_path, setting_problem
from modules.data.concepts import IMAGE_EXTENSIONS, media_files
from modules.data.controls import PairingError, folder_pairs, inside_control_folders, manifest_pairs


def pairs_text(cfg: TrainConfig) -> str:
    """One line per enabled concept with control images ('' when no concept has any)."""
    lines = []
    for index, concept in enumerate(cfg.data.concepts):
        if not concept.enabled or not concept.control.strip():
            continue
        name = concept.name or Path(concept.path).name or f"row {index + 1}"
        lines.append(f"{name}: {_count(concept.path, concept.control, concept.recursive)}")
    return ("Pairs - " + "; ".join(lines)) if lines else ""


def _count(path: str, setting: str, recursive: bool) -> str:
    if path.startswith("builtin:"):
        return "built-in pairs"
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return "the folder does not exist"
    if setting_problem(folder, setting, "Control"):
        return "the control folder or manifest does not exist"
    try:
        if is_manifest(setting):
            pairs = manifest_pairs(manifest_path(folder, setting))
            found = [p for p in pairs if p.target.is_file() and all(c.is_file() for c in p.controls)]
            missing = len(pairs) - len(found)
        else:
            targets = [f for f in media_files(folder, recursive, report_links=False)
                       if f.suffix.lower() in IMAGE_EXTENSIONS and not inside_control_folders(f, folder, setting)]
            found, unpaired = folder_pairs(folder, targets, setting, IMAGE_EXTENSIONS)
            missing = len(unpaired)
    except (OSError, PairingError) as err:
        return str(err).split("\n")[0]
    text = f"{len(found)} pair{'s' if len(found) != 1 else ''}"
    return text + (f", {missing} without a control image (skipped)" if missing else "")

