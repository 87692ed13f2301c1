"""Concept folders -> a flat list of training images with their captions.

The scan needs no model: it reads every image once (hash + PIL `verify()` + decode), so a broken file is
reported and skipped here, and an empty dataset fails here, before anything slow is loaded. Images are read
on several threads (`scan_threads`): reading, hashing and decoding release the GIL, and the scan is on the
path to every start (1,000 JPEGs at 1024 px took 2.7 s of a one-GPU start and 3.5-4.3 s of the launcher's
checks on the H200 hosts, one image at a time).
Warnings go to the `modules.data` logger, from the one process that scans for the run: a multi-process
launcher scans once and hands the scan to its workers; where every rank scans (a user's own torchrun),
`util/logs.setup_logging` keeps them to rank 0.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from PIL import Image, UnidentifiedImageError

from modules.config.train_config import ConceptConfig

from .builtin_datasets import resolve_concept_path
from .controls import (ControlImage, folder_pairs, inside_control_folders, is_manifest, manifest_pairs, manifest_path,
                       report_unpaired)
from .masks import find_mask, is_mask_file
from .video import VIDEO_EXTENSIONS, Window, probe_clip

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
    role: str = "train"
    """`train`, `regularisation` or `validation` (its concept's `role`)."""
    repeats: int = 1
    """Its concept's repeats."""
    loss_weight: float = 1.0
    """Its concept's loss weight."""
    mask_path: Path | None = None
    """The loss mask beside it (`masks.MASK_SUFFIX`) when its concept uses masks and it has one."""
    mask_hash: str = ""
    """sha256 of the mask file (its cache key part)."""
    unmasked_weight: float = 0.0
    """Loss weight of the mask's black areas (its concept's `unmasked_weight`)."""
    frame_count: int = 0
    """A video clip's frames (`video.py`); 0 for a still image."""
    frame_rate: float = 0.0
    """A video clip's average frames per second; 0 for a still image."""
    controls: tuple[ControlImage, ...] = ()
    """An edit model's control images of this target (its concept's `control`), in the model's order."""

    @property
    def is_clip(self) -> bool:
        return self.frame_count > 0


@dataclass(frozen=True)
class ScanResult:
    images: list[ImageRecord]
    """Each usable image once."""
    item_images: list[int]
    """Per dataset item (repeats expanded, regularisation items balanced, see `roles.py`), the index into `images`."""
    validation: list[ImageRecord] = field(default_factory=list)
    """The held-out images (validation concepts and `data.validation_fraction`), each once; not in `images`."""

    def to_dict(self) -> dict:
        """Plain JSON data (a launcher hands its scan to its workers in their job file)."""
        return {"images": [_record_to_dict(r) for r in self.images], "item_images": list(self.item_images),
                "validation": [_record_to_dict(r) for r in self.validation]}

    @classmethod
    def from_dict(cls, data: dict) -> "ScanResult":
        return cls(images=[_record_from_dict(r) for r in data["images"]], item_images=list(data["item_images"]),
                   validation=[_record_from_dict(r) for r in data["validation"]])


def _record_to_dict(record: ImageRecord) -> dict:
    data = dataclasses.asdict(record)
    data["path"] = str(record.path)
    data["mask_path"] = str(record.mask_path) if record.mask_path is not None else None
    data["controls"] = [{**dataclasses.asdict(c), "path": str(c.path)} for c in record.controls]
    return data


def _record_from_dict(data: dict) -> ImageRecord:
    return ImageRecord(**{**data, "path": Path(data["path"]),
                          "mask_path": Path(data["mask_path"]) if data.get("mask_path") else None,
                          "controls": tuple(ControlImage(**{**c, "path": Path(c["path"])})
                                            for c in data.get("controls", ()))})


CAPTION_FALLBACK_ENCODINGS = ("cp1252", "latin-1")
"""Tried in order when a caption file is not UTF-8: Windows' Western code page (what Notepad and many
older taggers wrote), then latin-1, which decodes any bytes, so a caption never stops a run."""


def read_caption(image_path: Path, caption_extension: str = ".txt") -> str:
    """The caption file beside the image, else the file name with underscores as spaces."""
    if caption_extension:
        ext = caption_extension if caption_extension.startswith(".") else "." + caption_extension
        caption_path = image_path.with_suffix(ext)
        if caption_path.is_file():
            return decode_caption(caption_path.read_bytes(), caption_path).strip()
    return image_path.stem.replace("_", " ").strip()


def decode_caption(data: bytes, path: Path) -> str:
    """UTF-8 (a byte-order mark is dropped); else the first fallback encoding that decodes it, with a warning."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        for encoding in CAPTION_FALLBACK_ENCODINGS:
            try:
                text = data.decode(encoding)
            except UnicodeDecodeError:
                continue
            log.warning("Caption %s is not UTF-8 (byte 0x%02x at position %d); read it as %s. Save it as UTF-8 "
                        "if some characters look wrong.", path, data[err.start], err.start, encoding)
            return text
        raise  # unreachable: latin-1 decodes any bytes


def process_caption(caption: str, rng: random.Random, dropout: float = 0.0,
                    shuffle_tags: bool = False, keep_tags: int = 0, prefix: str = "", suffix: str = "",
                    separator: str = ",") -> str:
    """Apply caption dropout, tag shuffling and the fixed prefix/suffix for one use of an image.

    Tags are the parts between `separator`s; the first `keep_tags` stay in place (typically the trigger
    word, when it is in the caption files), the rest are shuffled; `prefix` and `suffix` stay outside
    the shuffle. The rng is drawn from in a fixed order (dropout first) so that the same rng state always
    gives the same caption: seeded by (seed, epoch, item), a caption is the same on any number of GPUs.
    """
    if dropout > 0.0 and rng.random() < dropout:
        return ""
    if shuffle_tags:
        tags = [t.strip() for t in caption.split(separator)]
        tags = [t for t in tags if t]
        kept, rest = tags[:keep_tags], tags[keep_tags:]
        rng.shuffle(rest)
        caption = f"{separator} ".join(kept + rest)
    return with_prefix_and_suffix(caption, prefix, suffix, separator)


def with_prefix_and_suffix(caption: str, prefix: str, suffix: str, separator: str = ",") -> str:
    """`prefix, caption, suffix` (the empty parts left out), joined with `separator` and a space."""
    return f"{separator} ".join(part for part in (prefix.strip(), caption, suffix.strip()) if part)


def _image_files(folder: Path, recursive: bool, report_links: bool = True) -> list[Path]:
    """The images and video clips of a concept folder."""
    entries = list(folder.rglob("*") if recursive else folder.glob("*"))
    kinds = IMAGE_EXTENSIONS + VIDEO_EXTENSIONS
    files = [p for p in entries if p.is_file() and p.suffix.lower() in kinds and not is_mask_file(p)]
    if report_links:
        _report_links(folder, entries, recursive)
    # Sorted so that item indexes (and with them sampler order and RNG streams) are the same on
    # every rank and every run, whatever order the file system lists entries in.
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def media_files(folder: Path, recursive: bool, report_links: bool = True) -> list[Path]:
    """The images and video clips of a concept folder in the scan's order (the caption editor and
    auto-captioning list what training reads). `report_links=False`: without the line about skipped links, for
    what lists a folder on every edit (the GUI's pair count)."""
    return _image_files(folder, recursive, report_links)


def clip_files(concept: ConceptConfig) -> list[Path]:
    """The video clips of a concept folder, listed without reading them: a model that trains images only
    refuses them before the scan, which would judge each by `data.video_frames` (`preflight.check_family`).
    [] for a folder that is not there (the scan names it)."""
    folder = resolve_concept_path(concept.path)
    if not folder.is_dir():
        return []
    entries = folder.rglob("*") if concept.recursive else folder.glob("*")
    return sorted(p for p in entries if p.suffix.lower() in VIDEO_EXTENSIONS and p.is_file())


def _report_links(folder: Path, entries: list[Path], recursive: bool) -> None:
    """One line about the links the scan leaves out: linked folders (a recursive scan does not follow them,
    so a link back up - a loop - cannot make it endless) and links to images that are not there."""
    linked = [p for p in entries if recursive and p.is_symlink() and p.is_dir()]
    broken = [p for p in entries if p.is_symlink() and not p.exists() and p.suffix.lower() in IMAGE_EXTENSIONS]
    if not (linked or broken):
        return
    parts = []
    if linked:
        def shown(link: Path) -> str:
            target = link.resolve()
            loop = " (a loop)" if folder.resolve() == target or folder.resolve().is_relative_to(target) else ""
            return f"{link.relative_to(folder).as_posix()} -> {target}{loop}"
        parts.append(f"{len(linked)} linked folder(s), not followed: {_some(list(map(shown, linked)))}")
    if broken:
        parts.append(f"{len(broken)} link(s) to missing images: {_some([p.name for p in broken])}")
    log.warning("Ignored in %s: %s.", folder, "; ".join(parts))


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")


MAX_SCAN_THREADS = 8
"""At most this many images are read at once: each holds its file and its decoded pixels (a 24-megapixel
photo: ~70 MB) while it is checked."""


def scan_threads() -> int:
    """Threads the scan reads images on: the cores this process may use, at most `MAX_SCAN_THREADS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_SCAN_THREADS, cores))


def _image_info(path: Path) -> tuple[tuple[int, int, str] | None, str]:
    """((width, height, sha256), "") of a readable image, else (None, why it cannot be read)."""
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
        return None, _unreadable_reason(err, path)
    return (width, height, hashlib.sha256(data).hexdigest()), ""


def _read_images(paths: Sequence[Path]) -> list[tuple[int, int, str] | None]:
    """(width, height, sha256) of each image in `paths`, in order; None for an unreadable one, after one
    warning naming it and why (the warnings in the order of `paths`, whichever thread read them)."""
    threads = min(scan_threads(), len(paths))
    if threads <= 1:
        results = [_image_info(path) for path in paths]
    else:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tandem-scan") as pool:
            results = list(pool.map(_image_info, paths))
    for path, (_, reason) in zip(paths, results):
        if reason:
            log.warning("Skipping unreadable image %s: %s", path, reason)
    return [info for info, _ in results]


def _unreadable_reason(err: Exception, path: Path) -> str:
    # PIL names the in-memory buffer it was given ("cannot identify image file <_io.BytesIO ...>"),
    # which tells the user nothing; say what is wrong with the file instead.
    if isinstance(err, UnidentifiedImageError):
        size = path.stat().st_size if path.exists() else 0
        return "the file is empty" if size == 0 else "not an image format PIL can read (damaged, or not an image)"
    if isinstance(err, PermissionError):
        return "no permission to read it"
    text = str(err).strip() or type(err).__name__
    if isinstance(err, SyntaxError) or "truncated" in text.lower():
        return f"damaged or cut short ({text})"
    return text


UPSCALE_WARNING = 2.0
"""An image enlarged more than this to fill its bucket trains blurry: worth a word."""
DOWNSCALE_WARNING = 8.0
"""An image shrunk more than this is decoded whole each time it is loaded (once, with latents cached)."""


def report_sizes(images: Sequence[ImageRecord], bucket_sizes: list[tuple[int, int]]) -> None:
    """One line for images far smaller than their bucket (enlarged, blurry) and one for those far larger (shrunk
    at every load); both still train."""
    from .buckets import closest_bucket

    enlarged, shrunk = [], []
    for im in images:
        bucket_w, bucket_h = bucket_sizes[closest_bucket(im.width, im.height, bucket_sizes)]
        scale = max(bucket_w / im.width, bucket_h / im.height)
        shown = f"{im.path.name} {im.width}x{im.height} -> {bucket_w}x{bucket_h}"
        if scale > UPSCALE_WARNING:
            enlarged.append((scale, shown))
        elif 1 / scale > DOWNSCALE_WARNING:
            shrunk.append((1 / scale, shown))
    if enlarged:
        enlarged.sort(reverse=True)
        log.warning("%d image(s) are enlarged more than %gx to fill their bucket and will train blurry: %s. Use "
                    "larger images, or a lower data.resolution.", len(enlarged), UPSCALE_WARNING,
                    _some([text for _, text in enlarged]))
    if shrunk:
        shrunk.sort(reverse=True)
        log.warning("%d image(s) are shrunk more than %gx to fit their bucket, which decodes them whole at every "
                    "load (once, with data.cache_latents): %s.", len(shrunk), DOWNSCALE_WARNING,
                    _some([text for _, text in shrunk]))


DEFAULT_WINDOW = Window(frames=81, fps=16.0)
"""The clip window of a scan not given one (the defaults of data.video_frames and data.video_fps)."""


def scan_concept(concept: ConceptConfig, window: Window = DEFAULT_WINDOW) -> list[ImageRecord]:
    """Every usable image and clip of one concept (repeats not applied); clips must hold `window`."""
    return _scan_concept(concept, window)[0]


def _scan_concept(concept: ConceptConfig, window: Window = DEFAULT_WINDOW) -> tuple[list[ImageRecord], int]:
    """(usable images and clips, number of files skipped as unreadable or too short)."""
    folder = resolve_concept_path(concept.path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"Concept folder {concept.path!r} does not exist (resolved to {folder}). "
            "Fix data.concepts[].path or disable the concept.")
    name = concept.name or folder.name
    records = []
    files = _image_files(folder, concept.recursive)
    paired: dict[Path, tuple[tuple[ControlImage, ...], str | None]] = {}
    if concept.control.strip():
        files, paired = _pairs(concept, folder, files)
    images = [path for path in files if path.suffix.lower() not in VIDEO_EXTENSIONS]
    image_info = dict(zip(images, _read_images(images)))
    for path in files:
        clip = None
        if path.suffix.lower() in VIDEO_EXTENSIONS:
            clip = probe_clip(path, window)
            if clip is None:
                continue
            width, height, digest = clip.width, clip.height, clip.content_hash
        else:
            info = image_info[path]
            if info is None:
                continue
            width, height, digest = info
        mask = find_mask(path, width, height) if concept.masks and clip is None else None
        controls, caption = paired.get(path, ((), None))
        records.append(ImageRecord(path=path,
                                   caption=caption if caption is not None else read_caption(path, concept.caption_extension),
                                   concept=name, width=width, height=height, content_hash=digest,
                                   role=concept.role, repeats=concept.repeats, loss_weight=concept.loss_weight,
                                   mask_path=mask[0] if mask else None, mask_hash=mask[1] if mask else "",
                                   unmasked_weight=concept.unmasked_weight,
                                   frame_count=clip.frame_count if clip else 0,
                                   frame_rate=clip.frame_rate if clip else 0.0, controls=controls))
    if concept.control.strip() and not records:
        raise EmptyDatasetError(
            f"Concept {concept.path!r} has no image paired with a readable control image (data.concepts[].control "
            f"= {concept.control!r}; what is missing is named above). Put each control image under its image's file "
            "name in the control folder, or list the pairs in the manifest.")
    skipped = len(files) - len(records)
    if skipped:
        what = "image(s) or clip(s)" if any(p.suffix.lower() in VIDEO_EXTENSIONS for p in files) else "image(s)"
        log.warning("Skipped %d unreadable %s of %d in %s (each named above).", skipped, what, len(files), folder)
    unmasked = [r.path.name for r in records if r.mask_path is None]
    if concept.masks and unmasked:
        log.warning("%d of %d image(s) in %s have no mask (%s%s): they are trained whole. A mask is "
                    "<image name>-masklabel.png beside the image.", len(unmasked), len(records), folder,
                    ", ".join(unmasked[:3]), ", ..." if len(unmasked) > 3 else "")
    return records, skipped


def _pairs(concept: ConceptConfig, folder: Path, files: list[Path]
           ) -> tuple[list[Path], dict[Path, tuple[tuple[ControlImage, ...], str | None]]]:
    """(the targets to scan, each paired target's controls - read and checked - and manifest caption) of a concept
    with control images; targets without a readable control are left out, named in one warning."""
    setting = concept.control
    if is_manifest(setting):
        source = manifest_path(folder, setting)
        pairs = manifest_pairs(source)
        missing = [p.target for p in pairs if not p.target.is_file()]
        missing += [p.target for p in pairs if p.target.is_file() and not all(c.is_file() for c in p.controls)]
        pairs = [p for p in pairs if p.target.is_file() and all(c.is_file() for c in p.controls)]
    else:
        source = folder
        targets = [f for f in files if f.suffix.lower() in IMAGE_EXTENSIONS
                   and not inside_control_folders(f, folder, setting)]
        pairs, missing = folder_pairs(folder, targets, setting, IMAGE_EXTENSIONS)
    control_paths = list(dict.fromkeys(c for p in pairs for c in p.controls))
    info = dict(zip(control_paths, _read_images(control_paths)))
    unreadable = [p.target for p in pairs if any(info[c] is None for c in p.controls)]
    report_unpaired(source, missing, unreadable, len(pairs) + len(missing))
    kept = {p.target: (tuple(ControlImage(c, *info[c]) for c in p.controls), p.caption)
            for p in pairs if all(info[c] is not None for c in p.controls)}
    return list(kept), kept


def _check_pairing(concepts: Sequence[ConceptConfig], records: list[ImageRecord]) -> None:
    """Every image of a run has control images, as many as every other's, or none has: a batch stacks them."""
    with_controls = [c for c in concepts if c.control.strip()]
    if with_controls and len(with_controls) < len(concepts):
        plain = next(c for c in concepts if not c.control.strip())
        raise ValueError(
            f"Concept {plain.path!r} has no control images (data.concepts[].control is empty) while "
            f"{with_controls[0].path!r} has: an edit model trains on pairs only. Set its control folder, or disable it.")
    counts = {len(r.controls) for r in records}
    if len(counts) > 1:
        first = {n: next(r for r in records if len(r.controls) == n) for n in sorted(counts)}
        shown = "; ".join(f"{r.path} has {n}" for n, r in first.items())
        raise ValueError(f"Images have different numbers of control images ({shown}): every pair of a run needs as "
                         "many. Give each the same number of control images.")


def scan_concepts(concepts: Sequence[ConceptConfig], validation_fraction: float = 0.0,
                  window: Window = DEFAULT_WINDOW) -> ScanResult:
    """Scan all enabled concepts; raise `EmptyDatasetError` if no training concept holds a usable image.
    Video clips must hold `window` (`data.video_frames` at `data.video_fps`).

    Validation images (validation concepts, and `validation_fraction` of the training concepts' images) are
    set apart; regularisation images are balanced against the training images (`roles.epoch_items`)."""
    from .roles import epoch_items, hold_out
    records: list[ImageRecord] = []
    skipped = 0
    enabled = [c for c in concepts if c.enabled]
    for concept in enabled:
        if concept.repeats < 1:
            raise ValueError(f"Concept {concept.path!r} has repeats={concept.repeats}; "
                             "use 1 or more, or set enabled=false to leave it out.")
        found, unreadable = _scan_concept(concept, window)
        skipped += unreadable
        records += found
    _check_pairing(enabled, records)
    training = [r for r in records if r.role == "train"]
    if not training:
        trained = [c for c in enabled if c.role == "train"]
        folders = ", ".join(repr(c.path) for c in trained) or "(no enabled concept with role 'train')"
        found = f" (the {skipped} image file(s) there are unreadable, see above)" if skipped else ""
        raise EmptyDatasetError(
            f"No usable image found in the concept folders {folders}{found}. Add .png/.jpg/.jpeg/.webp "
            "images (or .mp4/.webm/.mov clips, for video models) there, fix data.concepts[].path, or enable a concept that has images.")
    kept, held = hold_out(training, validation_fraction)
    kept_ids = {id(r) for r in kept}
    images = [r for r in records if (r.role == "train" and id(r) in kept_ids) or r.role == "regularisation"]
    validation = [r for r in records if r.role == "validation"] + held
    return ScanResult(images=images, item_images=epoch_items(images), validation=validation)
