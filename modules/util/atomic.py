"""Writes that are either complete or absent: a crash mid-write never replaces a good file or folder.

Every file and folder Tandem writes for a user (configs, cache entries, models, backups) goes through
these helpers: write beside the target under a unique temporary name, then rename in one step. The
temporary file is made with O_EXCL|O_NOFOLLOW (mkstemp) and a target that is a symbolic link is refused
(`no_follow.py`).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from .no_follow import make_private_folder, refuse_link


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _default_file_mode() -> int:
    # mkstemp creates 0600 files; outputs should get the permissions any new file gets here.
    return 0o666 & ~_umask()


def _make_temporary_folder(**kwargs) -> Path:
    """mkdtemp's folder with the permissions any new folder gets here (mkdtemp makes it 0700 whatever
    the umask, and the rename keeps that: models and backups would be closed to the user's group)."""
    folder = Path(tempfile.mkdtemp(**kwargs))
    os.chmod(folder, 0o777 & ~_umask())
    return folder


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, follow_link: bool = False) -> Iterator[Path]:
    """Yields a temporary path beside `target`; on success it is renamed onto `target` in one step.

    A `target` that is a symbolic link is refused (`LinkRefused`, naming it: Tandem writes no file through a
    link in a workspace, `no_follow.py`), unless `follow_link`: then the file it points to is replaced - for
    a file the user chose (a config they save), which may well be a link on purpose."""
    target = Path(target)
    if follow_link:
        target = Path(os.path.realpath(target))
    make_private_folder(target.parent)
    refuse_link(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.chmod(tmp, _default_file_mode())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomically(target: str | os.PathLike, text: str, follow_link: bool = False) -> Path:
    with atomic_path(target, follow_link) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(target)


def save_safetensors_atomically(tensors: dict, target: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
    """One .safetensors file, written whole or not at all (tensors are copied to contiguous CPU memory)."""
    from safetensors.torch import save_file

    with atomic_path(target) as tmp:
        # safetensors refuses non-contiguous or shared-storage tensors; give it clean copies.
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    return Path(target)


def _follow_umask(root: Path) -> None:
    """Give everything under `root` the umask's permissions: safetensors (0.8) writes its files 0600
    whatever the umask, which would close the model and backup files to the user's group."""
    file_mode, folder_mode = _default_file_mode(), 0o777 & ~_umask()
    for folder, subfolders, files in os.walk(root):
        for name in subfolders:
            os.chmod(os.path.join(folder, name), folder_mode)
        for name in files:
            os.chmod(os.path.join(folder, name), file_mode)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yields an empty temporary folder beside `target`; on success it becomes `target`.

    Without `replace`, an existing `target` is an error (folders are never merged). With it, the old
    folder is moved aside and deleted only once the new one is in place, so at every moment either
    the complete old or the complete new folder exists.
    """
    tmp = begin_directory(target, replace)
    try:
        yield tmp
        commit_directory(tmp, target)
    finally:
        discard_directory(tmp)


def begin_directory(target: str | os.PathLike, replace: bool = False) -> Path:
    """The first half of `atomic_directory`, for a folder that several processes fill (sharded backups):
    an empty temporary folder beside `target`. Finish with `commit_directory`, or `discard_directory`."""
    target = Path(target)
    if target.exists() and not replace:
        raise FileExistsError(f"{target} already exists; refusing to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    return _make_temporary_folder(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)


def commit_directory(tmp: Path, target: str | os.PathLike) -> None:
    """Make the complete temporary folder `tmp` the folder `target` in one step (an old one is replaced),
    its contents given the umask's permissions first."""
    target = Path(target)
    _follow_umask(tmp)
    old = _set_aside(target) if target.exists() else None
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def delete_directory(folder: str | os.PathLike) -> None:
    """Delete `folder` so that it is either whole or gone: renamed out of sight first (`.NAME.XXXX.old`
    beside it), then deleted. A process killed mid-delete leaves that hidden leftover, never a folder that
    has lost some of its files under its own name (a backup without its state, still looking complete)."""
    shutil.rmtree(_set_aside(Path(folder)), ignore_errors=True)


def _set_aside(folder: Path) -> Path:
    """Rename `folder` to a new hidden name beside it (`.NAME.XXXX.old`) in one step; returns that name."""
    aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".old", dir=folder.parent))
    aside.rmdir()
    os.replace(folder, aside)
    return aside


def discard_directory(tmp: Path) -> None:
    """Delete a temporary folder that did not become its target (a no-op once committed)."""
    if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)


def build_folder_once(target: str | os.PathLike, build: Callable[[Path], None],
                      is_complete: Callable[[Path], bool]) -> Path:
    """Make sure a complete generated folder exists at `target`, building it at most once per caller.

    Safe when several processes call it at once (every rank of a run): each builds into its own
    temporary folder and renames it into place; a caller that loses the race drops its copy and uses
    the finished one. An incomplete or outdated folder at `target` is moved aside and deleted first.
    """
    target = Path(target)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    built = _make_temporary_folder(prefix=f".{target.name}-building-", dir=target.parent)
    try:
        build(built)
        if target.exists() and not is_complete(target):
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}-outdated-", dir=target.parent))
            aside.rmdir()
            try:
                os.replace(target, aside)
            except OSError:
                pass  # another process moved it first
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(built, target)
        except OSError:
            # Renaming onto a non-empty folder fails: another process finished first; use theirs.
            if not is_complete(target):
                raise
    finally:
        shutil.rmtree(built, ignore_errors=True)
    return target


def unique_path(path: str | os.PathLike, stamp: str) -> Path:
    """`path` if free, else the same name with `-stamp` before the suffix (then `-stamp-2`, ...: a run
    continued after it finished saves under its stamp again), so nothing is overwritten."""
    path = Path(path)
    if not path.exists():
        return path
    suffix = "".join(path.suffixes) if path.is_file() or path.suffix else ""
    stem = path.name[: len(path.name) - len(suffix)] if suffix else path.name
    candidate, n = path.with_name(f"{stem}-{stamp}{suffix}"), 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{stem}-{stamp}-{n}{suffix}")
    return candidate
