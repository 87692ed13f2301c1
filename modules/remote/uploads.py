"""Uploading datasets and models: only files the remote does not have yet, found by content hash.

The remote keeps `files/manifest.json` (each file's SHA-256 and size; `remote_side.manifest` drops entries
whose file vanished or changed size). The desktop hashes its files and sends those whose (SHA-256, size)
the manifest lacks, as one tar stream through ssh. So that a 7 GB model is read once, not at every start,
`HashCache` remembers the hash of a file of 64 KiB or more in `<settings>/upload-hashes.json` with its size,
modification time, change time and inode, and trusts it only while all four are unchanged; smaller files
(captions: the files edited by hand, in place, with their times kept by `cp -p` or an unzip) are read at
every start. Files the desktop no longer has are
deleted from the remote copy afterwards, so the remote dataset is the desktop's, not a superset.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from modules.util.atomic import write_text_atomically
from modules.util.settings_dir import settings_dir

from .machine import RemoteMachine
from .remote_config import Upload
from .ssh import SshError, last_lines

LARGE_UPLOAD_BYTES = 200 * 2**20
"""Uploads above this size are announced with their sizes and wait for a yes."""
CHUNK = 1 << 20


def size_text(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


ALWAYS_READ_BELOW = 64 * 1024
"""Files smaller than this are hashed at every start whatever their stat says: reading one costs about what
trusting it does, and these (captions, small configs) are the files edited in place."""
RECENT_NS = 2 * 10**9
"""A file changed less than this before it was hashed is not remembered: a later change within the same tick
of a coarse clock (1-2 s on some file systems) would leave its times as they were."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _stamp(stat: os.stat_result) -> list[int]:
    """What must be unchanged to trust a remembered hash. The change time: any write or utime() sets it to now
    on Linux and macOS and nobody can set it back, so an edit that restores the modification time (cp -p,
    rsync -t, an unzip) still changes it; the inode: a file replaced by another one (a rename over it) has a
    new one. On Windows st_ctime is the creation time, so there an in-place edit that keeps size and
    modification time is seen only in files below ALWAYS_READ_BELOW."""
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


class HashCache:
    """SHA-256 of local files; the hash of a large file is kept with its `_stamp` so that it is not read again
    while that is unchanged. Entries of the older (size, mtime) form never match and are replaced."""

    def __init__(self, path: Path | None = None, clock=time.time_ns):
        self.path = path or settings_dir() / "upload-hashes.json"
        self.clock = clock
        try:
            self.entries = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    def digest(self, path: Path) -> str:
        key, stat = str(path), path.stat()
        stamp = _stamp(stat)
        known = self.entries.get(key)
        if stat.st_size >= ALWAYS_READ_BELOW and known and known[:-1] == stamp:
            return known[-1]
        digest = file_sha256(path)
        unsure = (stat.st_size < ALWAYS_READ_BELOW or _stamp(path.stat()) != stamp  # changed while read
                  or self.clock() - max(stat.st_mtime_ns, stat.st_ctime_ns) < RECENT_NS)
        if not unsure:
            self.entries[key] = [*stamp, digest]
            self.changed = True
        elif self.entries.pop(key, None) is not None:
            self.changed = True
        return digest

    def save(self) -> None:
        if self.changed:
            write_text_atomically(self.path, json.dumps(self.entries))
            self.changed = False


@dataclass(frozen=True)
class FileEntry:
    local: Path
    remote: str
    """Relative to `<remote folder>/files`."""
    size: int
    digest: str


@dataclass
class UploadPlan:
    uploads: tuple[Upload, ...]
    files: list[FileEntry] = field(default_factory=list)
    missing: list[FileEntry] = field(default_factory=list)

    @property
    def bytes_to_send(self) -> int:
        return sum(f.size for f in self.missing)

    @property
    def large(self) -> bool:
        return self.bytes_to_send > LARGE_UPLOAD_BYTES

    def parts(self) -> list[str]:
        """One phrase per upload that sends something: `base model 6.9 GB (12 files)`."""
        found = []
        for upload in self.uploads:
            mine = [f for f in self.files if _under(f.remote, upload.remote)]
            send = [f for f in mine if f in self.missing]
            if send:
                count = (f"{len(send)} files" if len(send) == len(mine) else f"{len(send)} of {len(mine)} files changed")
                found.append(f"{upload.label} {size_text(sum(f.size for f in send))} ({count})")
        return found

    def message(self, label: str) -> str:
        if not self.missing:
            return f"{label} has every file of this run already"
        return f"Upload {size_text(self.bytes_to_send)} to {label}: " + "; ".join(self.parts())


def _under(name: str, root: str) -> bool:
    return name == root or name.startswith(root + "/")


def local_files(upload: Upload) -> list[tuple[Path, str]]:
    """(local path, remote name) of every file an upload sends; hidden files and folders are left out."""
    if upload.local.is_file():
        return [(upload.local, upload.remote)]
    if not upload.local.is_dir():
        raise FileNotFoundError(f"{upload.label}: {upload.local} does not exist")
    found = []
    pattern = upload.local.rglob("*") if upload.recursive else upload.local.glob("*")
    for path in sorted(pattern):
        relative = path.relative_to(upload.local)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            found.append((path, f"{upload.remote}/{relative.as_posix()}"))
    return found


def plan_uploads(machine: RemoteMachine, uploads: tuple[Upload, ...], hashes: HashCache | None = None) -> UploadPlan:
    hashes = hashes or HashCache()
    plan = UploadPlan(uploads)
    for upload in uploads:
        for path, remote in local_files(upload):
            plan.files.append(FileEntry(path, remote, path.stat().st_size, hashes.digest(path)))
    hashes.save()
    if not plan.files:
        return plan
    have = machine.side("manifest")
    plan.missing = [f for f in plan.files if have.get(f.remote) != [f.digest, f.size]]
    return plan


class _Counting:
    """A file object that reports how many bytes were read from it."""

    def __init__(self, f, report: Callable[[int], None]):
        self.f, self.report = f, report

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.report(len(data))
        return data


def send(machine: RemoteMachine, plan: UploadPlan, progress: Callable[[str], None] = lambda line: None) -> None:
    """Send the missing files as one tar stream through ssh, then record them in the remote manifest and
    delete remote files of these uploads that the desktop no longer has."""
    total, sent, shown = plan.bytes_to_send, 0, -1
    if plan.missing:
        process = machine.ssh.popen(f"mkdir -p {machine.path('files')} && tar -xf - -C {machine.path('files')}",
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        errors: list[bytes] = []
        reader = threading.Thread(target=lambda: errors.append(process.stderr.read()), daemon=True)
        reader.start()

        def count(n: int) -> None:
            nonlocal sent, shown
            sent += n
            tenth = int(10 * sent / max(total, 1))
            if tenth != shown:
                shown = tenth
                progress(f"uploading to {machine.label}: {size_text(sent)} of {size_text(total)}")
        try:
            with tarfile.open(fileobj=process.stdin, mode="w|") as tar:
                for entry in plan.missing:
                    info = tarfile.TarInfo(entry.remote)
                    # 0600: the user's alone there, also where tar keeps the archive's modes (a root login)
                    info.size, info.mode, info.mtime = entry.size, 0o600, int(entry.local.stat().st_mtime)
                    with open(entry.local, "rb") as f:
                        tar.addfile(info, _Counting(f, count))
            process.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # the connection ended; the exit code and stderr below say why
        code = process.wait()
        reader.join(10)
        stderr = b"".join(errors).decode("utf-8", errors="replace")
        if code == 255:
            raise machine.ssh.error(stderr)
        if code != 0:
            raise SshError("failed", f"upload to {machine.label} failed: {last_lines(stderr) or f'exit code {code}'}")
    machine.side("commit", input={"added": {f.remote: [f.digest, f.size] for f in plan.missing},
                                  "items": [u.remote for u in plan.uploads],
                                  "listing": [f.remote for f in plan.files]})
