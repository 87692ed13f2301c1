"""Paired data for edit models: each training image (the target, "after") with its control images ("before").

A concept names where its controls are in `data.concepts[].control` (`ConceptConfig.control`), in one of the
layouts people already have:

- **folders beside the images**, matched by file name: `control` (musubi-tuner's, ai-toolkit's and SimpleTuner's
  `control/` folder), or several for models that take several controls, `control_1, control_2`. A target
  `sub/cat.png` pairs with `control/sub/cat.<any image extension>`. Relative folders are inside the concept folder;
  their images are never targets themselves.
- **a JSON Lines manifest** (`pairs.jsonl`): one object per line, `{"target": "after/1.png", "control":
  ["before/1.png"], "caption": "make it red"}`; `control` may be one path, `caption` may be left out (the caption
  file beside the target, or its file name, is used then). Paths are relative to the manifest's folder.

Pairing only lists files; `concepts.py` reads every image once, skips a pair whose control is missing or unreadable
(named in one warning per concept) and refuses a concept left without pairs before any model loads.

A text encoder that sees the controls (Qwen-Image-Edit's Qwen2.5-VL) encodes a caption together with its pair's
controls. Such a text travels as one string (`text_with_controls`), so the text cache, which keys entries by their
text, keys them by the controls' content too, and everything that moves texts around (the cache, the sample
prompts, the text encoder's placements) carries it unchanged.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from modules.config.control_setting import control_folders, is_manifest, manifest_path, resolved  # noqa: F401

log = logging.getLogger(__name__)

class PairingError(ValueError):
    """A control setting or manifest that cannot be read as pairs (named with its file, line and field)."""


@dataclass(frozen=True)
class ControlImage:
    """One control image on disk, as found by the scan."""

    path: Path
    width: int
    height: int
    content_hash: str
    """sha256 of the file bytes (the cache key part that notices any edit of it)."""


@dataclass(frozen=True)
class Pair:
    """A target image and its control images' paths, before anything is read."""

    target: Path
    controls: tuple[Path, ...]
    caption: str | None = None
    """The manifest's caption; None: the target's caption file (or its name)."""


def folder_pairs(concept_folder: Path, targets: list[Path], setting: str,
                 extensions: tuple[str, ...]) -> tuple[list[Pair], list[Path]]:
    """(pairs, targets without a control in some folder) of the folders layout: each target's control is the file
    with its path (relative to the concept folder) and any of `extensions` in each control folder."""
    folders = control_folders(concept_folder, setting)
    by_stem = [_images_by_stem(folder, extensions) for folder in folders]
    pairs, unpaired = [], []
    for target in targets:
        stem = target.relative_to(concept_folder).with_suffix("").as_posix()
        found = [images.get(stem) for images in by_stem]
        if all(found):
            pairs.append(Pair(target, tuple(found)))
        else:
            unpaired.append(target)
    return pairs, unpaired


def _images_by_stem(folder: Path, extensions: tuple[str, ...]) -> dict[str, Path]:
    """Relative path without extension -> the image (the first by name when two share a stem)."""
    found: dict[str, Path] = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() in extensions and path.is_file():
            found.setdefault(path.relative_to(folder).with_suffix("").as_posix(), path)
    return found


def inside_control_folders(path: Path, concept_folder: Path, setting: str) -> bool:
    """Whether a file of the concept folder lies in one of its control folders (then it is no target)."""
    if not setting.strip() or is_manifest(setting):
        return False
    return any(path.is_relative_to(folder) for folder in control_folders(concept_folder, setting))


def manifest_pairs(path: Path) -> list[Pair]:
    """The pairs of a JSON Lines manifest, in its order; a malformed line raises `PairingError` naming it."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise PairingError(f"Cannot read the control manifest {path}: {err}. Save it as UTF-8 text.") from err
    pairs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise PairingError(f"{where}: not JSON ({err.msg}); write one object per line, such as "
                               '{"target": "after/1.png", "control": ["before/1.png"], "caption": "make it red"}.') from err
        if not isinstance(entry, dict):
            raise PairingError(f"{where}: a JSON object is expected, got {type(entry).__name__}.")
        target = entry.get("target")
        if not isinstance(target, str) or not target.strip():
            raise PairingError(f'{where}: "target" is missing or not a path; give the edited image\'s path.')
        controls = entry.get("control")
        if isinstance(controls, str):
            controls = [controls]
        if not isinstance(controls, list) or not controls or not all(isinstance(c, str) and c.strip() for c in controls):
            raise PairingError(f'{where}: "control" is missing or not a path or list of paths; give the image(s) the '
                               "caption's instruction edits.")
        caption = entry.get("caption")
        if caption is not None and not isinstance(caption, str):
            raise PairingError(f'{where}: "caption" must be text; leave it out to use the caption file beside the '
                               "target.")
        unknown = sorted(set(entry) - {"target", "control", "caption"})
        if unknown:
            raise PairingError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; the fields are "
                               '"target", "control" and "caption".')
        pairs.append(Pair(resolved(path.parent, target), tuple(resolved(path.parent, c) for c in controls),
                          caption.strip() if caption is not None else None))
    return pairs


def report_unpaired(where: Path, missing: list[Path], unreadable: list[Path], total: int) -> None:
    """One warning naming the images skipped for want of a readable control (each unreadable file was named
    as it was read)."""
    if not (missing or unreadable):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} without a control image ({_some([p.name for p in missing])})")
    if unreadable:
        parts.append(f"{len(unreadable)} whose control image is unreadable ({_some([p.name for p in unreadable])})")
    log.warning("Skipped %d of %d image(s) in %s: %s. A control image has its image's file name, in the control "
                "folder (or the manifest's \"control\").", len(missing) + len(unreadable), total, where,
                "; ".join(parts))


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")


_TEXT_MARK = "\x1etandem-controls\x1e"
"""Separates a caption from its controls in a text that carries them (a character no caption holds)."""


def text_with_controls(caption: str, controls: tuple[ControlImage, ...]) -> str:
    """One string with `caption` and its pair's controls: a text encoder that sees the controls encodes this,
    and the text cache keys it by the controls' content too."""
    return caption + _TEXT_MARK + json.dumps([[str(c.path), c.content_hash] for c in controls])


def split_text(text: str) -> tuple[str, list[Path]]:
    """(caption, control image paths) of a `text_with_controls` string; a plain caption has none."""
    caption, mark, rest = text.partition(_TEXT_MARK)
    if not mark:
        return text, []
    return caption, [Path(path) for path, _ in json.loads(rest)]


def sample_controls(setting: str) -> tuple[ControlImage, ...]:
    """A sample prompt's control images (`sampling.prompts[].control`: paths separated by commas), read once; a
    missing or unreadable one raises naming it."""
    import hashlib

    from PIL import Image

    from .builtin_datasets import resolve_file_path

    controls = []
    for part in (p for p in setting.split(",") if p.strip()):
        path = resolve_file_path(part)
        try:
            data = path.read_bytes()
            with Image.open(path) as img:
                width, height = img.size
        except OSError as err:
            raise ValueError(f"sampling.prompts[].control: cannot read {part.strip()!r} ({path}): {err}; give the path "
                             "of an image.") from err
        controls.append(ControlImage(path, width, height, hashlib.sha256(data).hexdigest()))
    return tuple(controls)


def control_picture(path: Path, width: int, height: int):
    """The control image at `path` as an RGB picture of `width` x `height`, scaled to cover it and cropped at the
    centre: how training crops a control to its image's bucket (`dataset.py`), for a sample of that size."""
    from PIL import Image

    from .buckets import apply_plan, plan_crop

    with Image.open(path) as img:
        img = img.convert("RGB")
    return apply_plan(img, plan_crop(img.width, img.height, (width, height)))
