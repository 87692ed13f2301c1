"""Reading and editing a concept folder's caption files: the caption editor's logic and auto-captioning's list.

Captions are read as training reads them (`concepts.read_caption`: the concept's caption extension, UTF-8
else the Western fallbacks, the file name when there is no caption file) over the files the scan lists
(`concepts.media_files`). Tags are split at the config's tag separator, as tag shuffling splits them.

Captions are the user's data, so every write here:
- is atomic (`util/atomic.py`): a crash leaves the old file or the new one, never half of one;
- refuses a caption file that is a symbolic link (`CaptionLinkError`): the file it points to - perhaps shared
  with another folder - stays as it is;
- checks that the file still holds what the edit was planned from (another program, or an auto-captioning
  run, may have written it since): a changed file is left alone and named (`StaleCaption`);
- a bulk edit is planned first (`BulkEdit`: exactly which files change, shown before anything is written)
  and applying it returns the edit that undoes it.
Bulk edits touch existing caption files only: an image without one trains on its file name, which adding a
tag to a new file would silently throw away.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from modules.util.atomic import write_text_atomically

from .concepts import IMAGE_EXTENSIONS, decode_caption, media_files, read_caption


class CaptionEditError(ValueError):
    """A caption edit that cannot be made; the message names the file and what to do."""


class CaptionLinkError(CaptionEditError):
    """The caption file is a symbolic link: the editor does not write through it."""


class StaleCaption(CaptionEditError):
    """The caption file changed on disk after the editor read it."""


def caption_extension(extension: str) -> str:
    """`.txt` for `txt` or `.txt`; "" when the concept reads no caption files (captions from file names)."""
    extension = extension.strip()
    return extension if not extension or extension.startswith(".") else "." + extension


@dataclass(frozen=True)
class CaptionEntry:
    """One image (or clip) of the folder with its caption as training reads it."""

    image: Path
    caption_file: Path | None
    """Where its caption file is or would be; None when the concept reads no caption files."""
    text: str
    """The caption training uses: the file's text (stripped), else the file name with underscores as spaces."""
    on_disk: str | None
    """The caption file's text exactly as read (None: there is no caption file): what a write checks against."""

    @property
    def has_caption(self) -> bool:
        return self.on_disk is not None

    @property
    def is_image(self) -> bool:
        return self.image.suffix.lower() in IMAGE_EXTENSIONS

    @property
    def is_link(self) -> bool:
        return self.caption_file is not None and self.caption_file.is_symlink()


def _read_file(path: Path) -> str | None:
    if not path.is_file():
        return None
    return decode_caption(path.read_bytes(), path)


def read_entry(image: Path, extension: str = ".txt") -> CaptionEntry:
    extension = caption_extension(extension)
    caption_file = image.with_suffix(extension) if extension else None
    on_disk = _read_file(caption_file) if caption_file is not None else None
    return CaptionEntry(image=image, caption_file=caption_file, text=read_caption(image, extension),
                        on_disk=on_disk)


def read_folder(folder: str | os.PathLike, extension: str = ".txt", recursive: bool = False) -> list[CaptionEntry]:
    """Every image and clip the scan would list in `folder`, in its order, with its caption."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise CaptionEditError(f"{folder} is not a folder: choose the concept's image folder.")
    return [read_entry(path, extension) for path in media_files(folder, recursive)]


def missing(entries: Iterable[CaptionEntry]) -> list[CaptionEntry]:
    """The entries without a caption file (they train on their file name)."""
    return [entry for entry in entries if not entry.has_caption]


def split_tags(text: str, separator: str = ",") -> list[str]:
    """The caption's tags: split at `separator`, stripped, empty ones left out."""
    if not separator:
        return [text.strip()] if text.strip() else []
    return [tag.strip() for tag in text.split(separator) if tag.strip()]


def join_tags(tags: Sequence[str], separator: str = ",") -> str:
    """Tags joined as the prefix and suffix are joined in training: separator and a space."""
    return f"{separator} ".join(tags)


def tag_counts(entries: Iterable[CaptionEntry], separator: str = ",") -> list[tuple[str, int]]:
    """How many caption files hold each tag (a tag twice in one caption counts once), most frequent first,
    then alphabetically. Images without a caption file are not counted (see `missing`)."""
    counts: Counter[str] = Counter()
    for entry in entries:
        if entry.has_caption:
            counts.update(set(split_tags(entry.text, separator)))
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


# --- writing --------------------------------------------------------------------------------------------

def _check_writable(caption_file: Path | None, image: Path) -> Path:
    if caption_file is None:
        raise CaptionEditError(f"{image.parent}: this concept reads no caption files (its Captions extension is "
                               "empty, so file names are its captions). Set the concept's Captions to .txt to "
                               "write captions.")
    if caption_file.is_symlink():
        raise CaptionLinkError(f"{caption_file} is a symbolic link (to {os.readlink(caption_file)}): the caption "
                               "editor does not write through links, so the file it points to stays as it is. "
                               "Replace the link with a copy of that file to edit this caption here.")
    return caption_file


def write_caption(caption_file: Path | None, image: Path, text: str, expected: str | None) -> None:
    """Write `text` as the caption, atomically, when the file still holds `expected` (None: no file yet);
    else `StaleCaption`. A link is refused (`CaptionLinkError`)."""
    caption_file = _check_writable(caption_file, image)
    now = _read_file(caption_file)
    if now != expected:
        raise StaleCaption(f"{caption_file} changed on disk since it was read (another program or an "
                           "auto-captioning run wrote it); it was left as it is. Reload to see it.")
    write_text_atomically(caption_file, text)


def _delete_caption(caption_file: Path, expected: str) -> None:
    """Undo of a file an edit made: deleted only when it still holds what the edit wrote."""
    if _read_file(caption_file) != expected:
        raise StaleCaption(f"{caption_file} changed on disk since the edit; it was left as it is.")
    caption_file.unlink()


@dataclass(frozen=True)
class Change:
    """One caption file's planned change; `old` None: the file does not exist yet, `new` None: delete it
    (only undo deletes, and only a file an edit made)."""

    image: Path
    caption_file: Path
    old: str | None
    new: str | None


@dataclass
class BulkEdit:
    """A planned edit of many caption files: `changes` lists exactly the files that change."""

    description: str
    changes: list[Change]
    skipped: list[str] = field(default_factory=list)
    """Files left out of the plan, each with why (a link, ...)."""

    def summary(self) -> str:
        """'<what>: 12 caption files change.' (the question asked before writing)."""
        count = len(self.changes)
        text = f"{self.description}: {count} caption file{'' if count == 1 else 's'} change{'s' if count == 1 else ''}."
        if self.skipped:
            text += f" {len(self.skipped)} left out: " + "; ".join(self.skipped[:3]) + (
                f"; ... ({len(self.skipped) - 3} more)" if len(self.skipped) > 3 else "")
        return text


@dataclass
class AppliedEdit:
    """What applying a `BulkEdit` did: the files written, those left as they were (with why), and the edit
    that undoes exactly the written ones."""

    written: list[Path]
    failed: list[str]
    undo: BulkEdit

    def summary(self) -> str:
        text = f"Wrote {len(self.written)} caption file{'' if len(self.written) == 1 else 's'}."
        if self.failed:
            text += f" {len(self.failed)} left as they were: " + "; ".join(self.failed[:3]) + (
                f"; ... ({len(self.failed) - 3} more)" if len(self.failed) > 3 else "")
        return text


def _plan(description: str, entries: Iterable[CaptionEntry], new_text) -> BulkEdit:
    """`new_text(entry)` for every entry with a caption file; only real changes are kept."""
    changes, skipped = [], []
    for entry in entries:
        if not entry.has_caption:
            continue
        new = new_text(entry)
        if new is None or new == entry.on_disk or new == entry.text:
            continue
        if entry.is_link:
            skipped.append(f"{entry.caption_file.name} is a symbolic link")
            continue
        changes.append(Change(entry.image, entry.caption_file, entry.on_disk, new))
    return BulkEdit(description, changes, skipped)


def plan_add(entries: Iterable[CaptionEntry], tag: str, separator: str = ",", at_start: bool = True) -> BulkEdit:
    """Add `tag` (a trigger word, or several tags) to every caption that lacks it: first, or last."""
    new_tags = split_tags(tag, separator)
    if not new_tags:
        raise CaptionEditError("Type the tag to add first.")

    def added(entry: CaptionEntry) -> str | None:
        tags = split_tags(entry.text, separator)
        extra = [t for t in new_tags if t not in tags]
        if not extra:
            return None
        return join_tags(extra + tags if at_start else tags + extra, separator)
    return _plan(f"Add {join_tags(new_tags, separator)!r} {'first' if at_start else 'last'}", entries, added)


def plan_remove(entries: Iterable[CaptionEntry], tag: str, separator: str = ",") -> BulkEdit:
    """Remove the tag `tag` (a whole tag, not text inside other tags) from every caption holding it."""
    gone = set(split_tags(tag, separator))
    if not gone:
        raise CaptionEditError("Type the tag to remove first.")

    def removed(entry: CaptionEntry) -> str | None:
        tags = split_tags(entry.text, separator)
        kept = [t for t in tags if t not in gone]
        return join_tags(kept, separator) if len(kept) != len(tags) else None
    return _plan(f"Remove {join_tags(sorted(gone), separator)!r}", entries, removed)


def plan_replace(entries: Iterable[CaptionEntry], find: str, replacement: str, separator: str = ",",
                 whole_tags: bool = False) -> BulkEdit:
    """Replace `find` with `replacement` in every caption: as plain text anywhere, or with `whole_tags`
    only tags that equal `find` (an empty `replacement` then removes them)."""
    if not find.strip():
        raise CaptionEditError("Type the text to find first.")

    def replaced(entry: CaptionEntry) -> str | None:
        if whole_tags:
            tags = split_tags(entry.text, separator)
            new = [replacement.strip() if t == find.strip() else t for t in tags]
            return join_tags([t for t in new if t], separator) if new != tags else None
        return entry.text.replace(find, replacement) if find in entry.text else None
    where = "whole tags" if whole_tags else "text"
    return _plan(f"Replace {find!r} with {replacement!r} ({where})", entries, replaced)


def apply_edit(edit: BulkEdit) -> AppliedEdit:
    """Write each planned change atomically; a file that changed on disk since the plan, or cannot be
    written, is left as it is and named. Returns what was done and the edit that undoes it."""
    written, failed, undo = [], [], []
    for change in edit.changes:
        try:
            if change.new is None:
                _delete_caption(change.caption_file, change.old)
            else:
                write_caption(change.caption_file, change.image, change.new, change.old)
        except (CaptionEditError, OSError) as error:
            failed.append(str(error))
            continue
        written.append(change.caption_file)
        undo.append(Change(change.image, change.caption_file, change.new, change.old))
    return AppliedEdit(written, failed, BulkEdit(f"Undo: {edit.description}", undo))
