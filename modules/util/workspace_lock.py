"""One run per workspace at a time.

Two runs writing the same workspace overwrite each other's backups and models while both report
success. The process that starts a run (the launcher, or a single-process run) takes an exclusive
lock on `<workspace>/.tandem/lock` for the run's whole life. It is an operating-system lock on an
open file (flock on Linux/macOS, msvcrt on Windows), so it is released by the system when the process
ends for any reason: a crashed or killed run never leaves the workspace locked. The file itself keeps
who holds it (process, host, start time, command), so a refused run can name the run in the way.
The workers of a launcher that holds the lock learn it from their job and take no workspace lock.

Workers outlive their launcher for a moment when it is killed (they end with it, but not in the same
instant), and two runs must never write at once: each worker holds a lock of its own
(`<workspace>/.tandem/workers/rank-K.lock`, `WorkerLock`) for its life, and taking the workspace waits
for those of an earlier run to be released (`WORKERS_GRACE_S`), then refuses, naming them.

None of these files, nor `.tandem` or `workers`, may be a symbolic link (`no_follow.py`): a lock file that
links elsewhere would have its target overwritten with the holder's details, so it is refused, naming it.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from .no_follow import (LinkRefused, make_private_folder, open_no_follow, refuse_linked_private_folders,
                        refuse_links_inside)


WORKERS_GRACE_S = 30.0
"""How long taking the workspace waits for the workers of an earlier run to end (their launcher was killed:
they end with it within seconds)."""


class WorkspaceBusy(RuntimeError):
    """Another run holds the workspace."""


def lock_file(workspace: str | os.PathLike) -> Path:
    return Path(workspace).expanduser() / ".tandem" / "lock"


def worker_lock_folder(workspace: str | os.PathLike) -> Path:
    return Path(workspace).expanduser() / ".tandem" / "workers"


def try_lock(fd: int) -> bool:
    """Take an exclusive lock on the open file `fd` without waiting: True when taken (Windows or POSIX)."""
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
        with os.fdopen(open_no_follow(path, os.O_RDONLY), encoding="utf-8") as file:
            info = json.loads(file.read())
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

    def acquire(self, record: bool = True, wait_for_workers: bool = True) -> "WorkspaceLock":
        """Take the lock or raise WorkspaceBusy naming the holder; `record` writes who holds it now;
        `wait_for_workers`: also wait for the workers of an earlier run to end (`WORKERS_GRACE_S`)."""
        try:
            make_private_folder(self.path.parent)
            refuse_links_inside(self.path.parent)  # the lock, commands, workers' locks: none may be a link
            fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        except LinkRefused as e:
            raise WorkspaceBusy(str(e)) from None
        except OSError as e:
            raise WorkspaceBusy(f"general.workspace_dir {str(self.workspace)!r} cannot be written ({e.strerror}); "
                                "choose a folder you can write to.") from None
        if not try_lock(fd):
            os.close(fd)
            raise WorkspaceBusy(f"general.workspace_dir {str(self.workspace)!r} is in use by another run "
                                f"({_holder_text(self.path)}). Wait for it to finish or stop it, or choose "
                                "another workspace for this run.")
        self._fd = fd
        try:
            if wait_for_workers:
                self._wait_for_earlier_workers()
        except LinkRefused as e:
            self.release()
            raise WorkspaceBusy(str(e)) from None
        except WorkspaceBusy:
            self.release()
            raise
        if not record:
            return self
        details = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                              "command": " ".join(sys.argv)}).encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, details, 0) if hasattr(os, "pwrite") else os.write(fd, details)
        return self

    def _wait_for_earlier_workers(self) -> None:
        """Until no worker of an earlier run holds its lock; WorkspaceBusy naming them after `WORKERS_GRACE_S`
        (read at each call, not bound once at import, so that a caller or test can change it)."""
        deadline = time.monotonic() + WORKERS_GRACE_S
        while True:
            living = workers_alive(self.workspace)
            if not living:
                return
            if time.monotonic() >= deadline:
                raise WorkspaceBusy(f"general.workspace_dir {str(self.workspace)!r}: worker processes of an earlier run "
                                    f"are still running ({'; '.join(living)}) although their launcher has ended. "
                                    "Wait for them to end, or end them, before starting a run here.")
            time.sleep(0.2)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    def __enter__(self) -> "WorkspaceLock":
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class WorkerLock:
    """One worker's hold on the workspace for its life (released by the system when the process ends)."""

    def __init__(self, workspace: str | os.PathLike, rank: int) -> None:
        self.path = worker_lock_folder(workspace) / f"rank-{rank}.lock"
        self._fd: int | None = None

    def acquire(self) -> "WorkerLock":
        """Hold it; a worker whose lock cannot be had (a stale one of this rank still living) goes on without.
        A lock file or folder that is a symbolic link is refused (`LinkRefused`, naming it)."""
        try:
            make_private_folder(self.path.parent)
            fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        except LinkRefused:
            raise
        except OSError:
            return self
        if not try_lock(fd):
            os.close(fd)
            return self
        details = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                              "command": f"{self.path.stem} of a training run"}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, details, 0) if hasattr(os, "pwrite") else os.write(fd, details)
        self._fd = fd
        return self


def workers_alive(workspace: str | os.PathLike) -> list[str]:
    """The workers that hold their lock in `workspace` ("process 123 on host, started ..."), if any;
    `LinkRefused` when the folder or a lock file in it is a symbolic link."""
    folder = worker_lock_folder(workspace)
    if not folder.is_dir() and not folder.is_symlink():
        return []
    refuse_linked_private_folders(folder / "rank-0.lock")  # a linked `.tandem` or `workers`
    living = []
    for path in sorted(folder.glob("rank-*.lock")):
        try:
            fd = open_no_follow(path, os.O_RDWR)
        except LinkRefused:
            raise
        except OSError:
            continue
        try:
            if try_lock(fd):
                continue  # nobody holds it: that worker has ended (closing the descriptor drops the lock)
            living.append(_holder_text(path))
        finally:
            os.close(fd)
    return living


def workspace_in_use(workspace: str | os.PathLike) -> str | None:
    """Who holds the workspace, or None when it is free (the GUI asks before it starts a run);
    `LinkRefused` when `.tandem` holds a symbolic link (a run would refuse the workspace for it)."""
    lock = WorkspaceLock(workspace)
    if os.path.lexists(lock.path.parent):
        refuse_links_inside(lock.path.parent)  # as taking it would, but raised as it is: not "in use"
    if not lock.path.exists():
        return None
    try:
        lock.acquire(record=False, wait_for_workers=False)
    except WorkspaceBusy:
        return _holder_text(lock.path)
    lock.release()
    living = workers_alive(workspace)
    return f"worker processes of an earlier run: {'; '.join(living)}" if living else None
