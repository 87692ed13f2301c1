"""What of the desktop's Tandem is shipped to a remote, and the version that names it.

The remote runs the same code as the desktop: the repository's files as they are on disk (`git ls-files`:
tracked ones and new ones .gitignore does not leave out; without git, the tree less the folders .gitignore
names), so a desktop with local
changes trains with them remotely too. The version is a hash of those files' names and contents:
the same tree gives the same version on every desktop, and a remote that already has it gets nothing.
"""
from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LEFT_OUT_DIRS = {".git", ".venv", "__pycache__", "workspace", ".cache", "build", ".pytest_cache", ".whl",
                 ".bench", ".tandem"}
"""Without git: folders never shipped (environments, caches, run folders), as .gitignore lists them."""
EXECUTABLE_SUFFIXES = (".sh",)


@dataclass(frozen=True)
class Source:
    root: Path
    files: tuple[str, ...]
    """Paths relative to `root`, with forward slashes, sorted."""
    version: str
    """12 hex digits of the files' hash."""
    commit: str
    """The git commit (`abc1234`, `abc1234+changes`), or "" outside a git checkout."""

    def describe(self) -> str:
        return f"{self.version}" + (f" (git {self.commit})" if self.commit else "")


def _git(root: Path, *args: str) -> str | None:
    try:
        result = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def _walk(root: Path) -> list[str]:
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in LEFT_OUT_DIRS and not d.endswith(".egg-info"))
        for name in names:
            if not name.endswith(".pyc"):
                found.append((Path(folder) / name).relative_to(root).as_posix())
    return found


def _content(root: Path, name: str) -> bytes:
    data = (root / name).read_bytes()
    # A Windows checkout may have turned shell scripts' line ends into CRLF, which bash on the remote refuses.
    return data.replace(b"\r\n", b"\n") if name.endswith(EXECUTABLE_SUFFIXES) else data


def local_source(root: Path = REPO) -> Source:
    # Tracked files, and new ones not yet added that .gitignore does not leave out: the tree as it is.
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    names = (sorted({n for n in listed.split("\0") if n and (root / n).is_file()}) if listed is not None
             else sorted(_walk(root)))
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0" + hashlib.sha256(_content(root, name)).digest())
    commit = ""
    head = _git(root, "rev-parse", "--short", "HEAD")
    if head:
        changed = _git(root, "status", "--porcelain", "--untracked-files=no")
        commit = head.strip() + ("+changes" if changed else "")
    return Source(root, tuple(names), digest.hexdigest()[:12], commit)


def archive(source: Source) -> bytes:
    """The files as a gzipped tar (a few MB), modes set here so that a Windows desktop ships runnable scripts."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in source.files:
            data = _content(source.root, name)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if name.endswith(EXECUTABLE_SUFFIXES) else 0o644
            info.mtime = int((source.root / name).stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
