"""Writes that are either complete or absent: a crash mid-write never replaces a good file."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path beside `target`; on success it is renamed onto `target` in one step."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty temporary folder beside `target`; on success it becomes `target`.

    `target` must not exist yet: folders are never merged or half-overwritten.
    """
    target = Path(target)
    if target.exists():
        raise FileExistsError(f"{target} already exists; refusing to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def unique_path(path: str | os.PathLike, stamp: str) -> Path:
    """`path` if free, else the same name with `-stamp` before the suffix, so nothing is overwritten."""
    path = Path(path)
    if not path.exists():
        return path
    suffix = "".join(path.suffixes) if path.is_file() or path.suffix else ""
    stem = path.name[: len(path.name) - len(suffix)] if suffix else path.name
    return path.with_name(f"{stem}-{stamp}{suffix}")
