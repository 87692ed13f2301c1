"""Concept folders -> a flat list of training images with their captions.

The scan needs no model: it reads every image once (hash + PIL `verify()`), so a broken file is
reported and skipped here, and an empty dataset fails here, before anything slow is loaded.
"""
from __future__ import annotations

import hashlib
import io
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from PIL import Image, UnidentifiedImageError

from modules.config.train_config import ConceptConfig

from .demo_dataset import resolve_concept_path

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")


class EmptyDatasetError(ValueError):
    """No usable image in any enabled concept."""


@dataclass(frozen=True)
class ImageRecord:
    """One image on disk, as found by the scan."""

    path: Path
    caption: str
    concept: str
    width: int
    height: int
    content_hash: str
    """sha256 of the file bytes: the cache key part that notices any edit of the image."""


@dataclass(frozen=True)
class ScanResult:
    images: list[ImageRecord]
    """Each usable image once."""
    item_images: list[int]
    """Per dataset item (repeats expanded), the index into `images`."""


def read_caption(image_path: Path, caption_extension: str = ".txt") -> str:
    """The caption file beside the image, else the file name with underscores as spaces."""
    if caption_extension:
        ext = caption_extension if caption_extension.startswith(".") else "." + caption_extension
        caption_path = image_path.with_suffix(ext)
        if caption_path.is_file():
            return caption_path.read_text(encoding="utf-8").strip()
    return image_path.stem.replace("_", " ").strip()


def process_caption(caption: str, rng: random.Random, dropout: float = 0.0,
                    shuffle_tags: bool = False, keep_tags: int = 0) -> str:
    """Apply caption dropout and tag shuffling for one use of an image.

    Tags are the comma-separated parts; the first `keep_tags` stay in place (typically the
    trigger word), the rest are shuffled. The rng is drawn from in a fixed order (dropout first)
    so that the same rng state always gives the same caption.
    """
    if dropout > 0.0 and rng.random() < dropout:
        return ""
    if not shuffle_tags:
        return caption
    tags = [t.strip() for t in caption.split(",")]
    tags = [t for t in tags if t]
    kept, rest = tags[:keep_tags], tags[keep_tags:]
    rng.shuffle(rest)
    return ", ".join(kept + rest)


def _image_files(folder: Path, recursive: bool) -> list[Path]:
    pattern = folder.rglob("*") if recursive else folder.glob("*")
    files = [p for p in pattern if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS]
    # Sorted so that item indexes (and with them sampler order and RNG streams) are the same on
    # every rank and every run, whatever order the file system lists entries in.
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _read_image(path: Path) -> tuple[int, int, str] | None:
    """(width, height, sha256) of a readable image, else None after one warning naming it."""
    try:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
        # verify() leaves the image unusable; a second open gives the size and makes sure the
        # decoder can really start on it.
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            img.load()
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as err:
        log.warning("Skipping unreadable image %s: %s", path, err)
        return None
    return width, height, hashlib.sha256(data).hexdigest()


def scan_concept(concept: ConceptConfig) -> list[ImageRecord]:
    """Every usable image of one concept (repeats not applied)."""
    folder = resolve_concept_path(concept.path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"Concept folder {concept.path!r} does not exist (resolved to {folder}). "
            "Fix data.concepts[].path or disable the concept.")
    name = concept.name or folder.name
    records = []
    for path in _image_files(folder, concept.recursive):
        info = _read_image(path)
        if info is None:
            continue
        width, height, digest = info
        records.append(ImageRecord(path=path, caption=read_caption(path, concept.caption_extension),
                                   concept=name, width=width, height=height, content_hash=digest))
    return records


def scan_concepts(concepts: Sequence[ConceptConfig]) -> ScanResult:
    """Scan all enabled concepts; raise `EmptyDatasetError` if none holds a usable image."""
    images: list[ImageRecord] = []
    item_images: list[int] = []
    enabled = [c for c in concepts if c.enabled]
    for concept in enabled:
        if concept.repeats < 1:
            raise ValueError(f"Concept {concept.path!r} has repeats={concept.repeats}; "
                             "use 1 or more, or set enabled=false to leave it out.")
        for record in scan_concept(concept):
            index = len(images)
            images.append(record)
            item_images.extend([index] * concept.repeats)
    if not images:
        folders = ", ".join(repr(c.path) for c in enabled) or "(no enabled concept)"
        raise EmptyDatasetError(
            f"No usable image found in the concept folders {folders}. Add .png/.jpg/.jpeg/.webp "
            "images there, fix data.concepts[].path, or enable a concept that has images.")
    return ScanResult(images=images, item_images=item_images)
