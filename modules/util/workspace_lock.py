"""One run per workspace at a time.

Two runs writing the same workspace overwrite each other's backups and models while both report
success. The process that starts a run (the launcher, or a single-process run) takes an exclusive
lock on `<workspace>/.tandem/lock` for the run's whole life. It is an operating-system lock on an
open file (flock on Linux/macOS, msvcrt on Windows), so it is released by the system when the process
ends for any reason: a crashed or killed run never leaves the workspace locked. The file itself keeps
who holds it (process, host, start time, command), so a refused run can name the run in the way.
Worker processes started by a launcher that holds the lock are told so through TANDEM_WORKSPACE_LOCKED.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

HELD_BY_PARENT = "TANDEM_WORKSPACE_LOCKED"
"""Set (to the lock file's path) for processes started by a process that holds the workspace lock."""


class WorkspaceBusy(RuntimeError):
    """Another run holds the workspace."""


def lock_file(workspace: str | os.PathLike) -> Path:
    return Path(workspace).expanduser() / ".tandem" / "lock"


def _try_lock(fd: int) -> bool:
    if os.name == "nt":
        import msvcrt
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    import fcntl
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def _holder_text(path: Path) -> str:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return f"process {info['pid']} on {info['host']}, started {started}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its details yet)"


class WorkspaceLock:
    """Held from `acquire()` until `release()` or the end of the process."""

    def __init__(self, workspace: str | os.PathLike) -> None:
        self.workspace = Path(workspace).expanduser()
        self.path = lock_file(self.workspace)
        self._fd: int | None = None

    def acquire(self, record: bool = True) -> "WorkspaceLock":
        """Take the lock or raise WorkspaceBusy naming the holder; `record` writes who holds it now."""
        if os.environ.get(HELD_BY_PARENT) == str(self.path.resolve()):
            return self  # the launcher that started this process holds it
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise WorkspaceBusy(f"general.workspace_dir {str(self.workspace)!r} cannot be written ({e.strerror}); "
                                "choose a folder you can write to.") from None
        if not _try_lock(fd):
            os.close(fd)
            raise WorkspaceBusy(f"general.workspace_dir {str(self.workspace)!r} is in use by another run "
                                f"({_holder_text(self.path)}). Wait for it to finish or stop it, or choose "
                                "another workspace for this run.")
        self._fd = fd
        if not record:
            return self
        details = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                              "command": " ".join(sys.argv)}).encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, details, 0) if hasattr(os, "pwrite") else os.write(fd, details)
        return self

    def child_environment(self) -> dict[str, str]:
        """What processes started by this one need to know that the lock is held for them."""
        return {HELD_BY_PARENT: str(self.path.resolve())}

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    def __enter__(self) -> "WorkspaceLock":
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def workspace_in_use(workspace: str | os.PathLike) -> str | None:
    """Who holds the workspace, or None when it is free (the GUI asks before it starts a run)."""
    lock = WorkspaceLock(workspace)
    if not lock.path.exists():
        return None
    try:
        lock.acquire(record=False)
    except WorkspaceBusy:
        return _holder_text(lock.path)
    lock.release()
    return None
