"""No file Tandem writes in a workspace is written through a symbolic link.

A link planted in a workspace (`.tandem/lock` -> `~/.bashrc`) would make a run overwrite, truncate or
append to whatever it points at, with the user's rights. So:
- files are opened with O_NOFOLLOW (`open_no_follow`, `open_text_no_follow`): a link as the file's own
  name fails to open instead of being followed, and is refused with `LinkRefused`, naming it;
- `<workspace>/.tandem`, Tandem's own folder, and every folder below it may not be a link
  (`refuse_linked_private_folders`): its files would be written into the folder it points at;
- atomic writes (`atomic.py`) refuse a link as their target too (their rename would replace the link,
  which is harmless, but a link where Tandem keeps a file is a mistake or an attack: say so).
Folders the user sees (output, backups, samples, cache, tensorboard) may be links on purpose - onto
another disk - and are followed; their files are written whole by `atomic.py`.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TextIO

PRIVATE_FOLDER = ".tandem"
"""Tandem's own folder in a workspace (locks, commands, the workers' job): no link anywhere in it."""

_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # not on Windows: checked with lstat there
_CLOSE_ON_EXEC = getattr(os, "O_CLOEXEC", 0)
_LINK_ERRORS = (errno.ELOOP, errno.EMLINK)  # O_NOFOLLOW on a link: ELOOP (Linux, macOS), EMLINK (FreeBSD)


class LinkRefused(OSError):
    """A file or folder Tandem writes in a workspace is a symbolic link; the message names it."""


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def refuse_link(path: str | os.PathLike, what: str = "file") -> None:
    """Raise `LinkRefused` when `path` itself is a symbolic link."""
    path = Path(path)
    if not path.is_symlink():
        return
    if what == "folder":
        raise LinkRefused(f"{path} is a symbolic link (to {_link_target(path)}): Tandem's own folder in a workspace "
                          "may not be a link, or its files would be written where it points. Delete the link "
                          "(Tandem makes the folder itself) and start again.")
    raise LinkRefused(f"{path} is a symbolic link (to {_link_target(path)}): Tandem writes no file through a link in "
                      "a workspace, as that would change the file it points to. Delete the link (Tandem makes "
                      "the file itself) and start again.")


def refuse_linked_private_folders(path: str | os.PathLike) -> None:
    """Raise `LinkRefused` when `.tandem`, or a folder below it, on the way to `path` is a link (folders
    above `.tandem` - the workspace itself - may be links: the user chose them)."""
    parts = Path(path).parts
    private = [i for i, part in enumerate(parts[:-1]) if part == PRIVATE_FOLDER]
    if not private:
        return
    for end in range(private[-1] + 1, len(parts)):  # `.tandem`, then each folder below it
        refuse_link(Path(*parts[:end]), "folder")


def make_private_folder(folder: str | os.PathLike) -> Path:
    """`folder` made (with its parents) and checked: no link from `.tandem` down to it (outside `.tandem`,
    just made)."""
    folder = Path(folder)
    refuse_linked_private_folders(folder / "file")
    folder.mkdir(parents=True, exist_ok=True)
    refuse_linked_private_folders(folder / "file")  # a link made meanwhile
    return folder


def open_no_follow(path: str | os.PathLike, flags: int, mode: int = 0o666) -> int:
    """`os.open(path, flags)` that refuses a link as `path` or as a folder of `.tandem` on its way
    (`LinkRefused`, naming it); other errors are raised as they are."""
    path = Path(path)
    refuse_linked_private_folders(path)
    if not _NO_FOLLOW:
        refuse_link(path)
    try:
        return os.open(path, flags | _NO_FOLLOW | _CLOSE_ON_EXEC, mode)
    except OSError as error:
        if error.errno in _LINK_ERRORS and path.is_symlink():
            refuse_link(path)
        raise


def open_text_no_follow(path: str | os.PathLike, mode: str) -> TextIO:
    """A UTF-8 text file opened for writing ("w": emptied first, "a": appended to) without following a link;
    its folder is made first."""
    flags = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND}[mode]
    path = Path(path)
    make_private_folder(path.parent)
    return os.fdopen(open_no_follow(path, flags), mode, encoding="utf-8")


def refuse_links_inside(folder: str | os.PathLike) -> None:
    """Raise `LinkRefused` naming the first symbolic link in `folder` or below it (`.tandem` holds none:
    checked when a run takes the workspace, so that a planted link stops the run before anything is written)."""
    folder = Path(folder)
    refuse_link(folder, "folder")
    for parent, folders, files in os.walk(folder):  # links to folders are listed, not entered
        for name in sorted(folders + files):
            refuse_link(Path(parent) / name, "folder" if name in folders else "file")
