"""The queue file: `<Tandem's home>/queue/queue.json` for this machine's queue (`$TANDEM_HOME`, else
~/.config/tandem, as the GUI's settings), `<remote folder>/queue/queue.json` on a remote machine.

Every change is read-modify-write under one lock (`queue.lock`, an operating-system lock the system releases
when its holder dies) and written atomically (a temporary file renamed over the old one), so the GUI, the
command line and the runner can change the queue at the same moment and a reader never sees half a file.
Nobody holds the lock for longer than a read and a write: starting a job, stopping one and waiting happen
outside it. The folder is the user's alone (jobs' variables may hold tokens).
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from modules.util.atomic import write_text_atomically
from modules.util.settings_dir import settings_dir
from modules.util.workspace_lock import try_lock

from .jobs import Job

QUEUE_FILE, LOCK_FILE, RUNNER_LOCK, RUNNER_LOG = "queue.json", "queue.lock", "runner.lock", "runner.log"
FORMAT = 1


def default_folder() -> Path:
    """This machine's queue."""
    return settings_dir() / "queue"


class QueueFileError(RuntimeError):
    """The queue file cannot be read as a queue (it is kept; nothing overwrites it)."""


@dataclass
class QueueState:
    jobs: list[Job] = field(default_factory=list)
    """In queue order: the first queued job starts first."""
    paused: bool = False
    """No job starts while the whole queue is paused; running ones go on."""
    slots: int | None = None
    """How many jobs' worth of GPUs this machine offers, set by hand (`--slots`): on a machine without GPUs,
    how many CPU processes run at once. None: the GPUs are counted."""
    runs_root: str = ""
    """The folder whose `runs/` holds the jobs' runs ("": the queue's folder)."""
    next_id: int = 1
    runner: dict = field(default_factory=dict)
    """The runner's pid, host and start; and the GPU count it found (`capacity`), for the views."""

    def find(self, key: str | int) -> Job:
        """A job by number (`3`, `#3`) or by its unique name."""
        text = str(key).strip().lstrip("#")
        if text.isdigit():
            for job in self.jobs:
                if job.id == int(text):
                    return job
        named = [job for job in self.jobs if job.name == str(key)]
        if len(named) == 1:
            return named[0]
        if len(named) > 1:
            raise KeyError(f"{len(named)} jobs are named {key!r} ({', '.join(j.label() for j in named)}): give "
                           "its number")
        raise KeyError(f"no job {key!r} in the queue ({', '.join(j.label() for j in self.jobs) or 'it is empty'})")

    def to_dict(self) -> dict:
        return {"format": FORMAT, "paused": self.paused, "slots": self.slots, "runs_root": self.runs_root,
                "next_id": self.next_id, "runner": self.runner, "jobs": [job.to_dict() for job in self.jobs]}

    @classmethod
    def from_dict(cls, data: dict) -> QueueState:
        jobs = [Job.from_dict(entry) for entry in data.get("jobs", [])]
        slots = data.get("slots")
        return cls(jobs=jobs, paused=bool(data.get("paused", False)),
                   slots=int(slots) if isinstance(slots, int) and slots > 0 else None,
                   runs_root=str(data.get("runs_root") or ""),
                   next_id=max([int(data.get("next_id", 1))] + [j.id + 1 for j in jobs]),
                   runner=dict(data.get("runner") or {}))


def _lock(fd: int) -> None:
    if os.name == "nt":
        import msvcrt
        while True:
            try:
                msvcrt.locking(fd, msvcrt.LK_LOCK, 1)  # waits up to 10 s, then raises: wait again
                return
            except OSError:
                continue
    import fcntl
    fcntl.flock(fd, fcntl.LOCK_EX)


class QueueStore:
    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = Path(folder).expanduser() if folder else default_folder()
        self.file = self.folder / QUEUE_FILE

    @property
    def runs_root(self) -> Path:
        state = self.read()
        return Path(state.runs_root).expanduser() if state.runs_root else self.folder

    def read(self) -> QueueState:
        """The queue as last written (no lock: every write replaces the file whole); empty when there is none."""
        try:
            text = self.file.read_text(encoding="utf-8")
        except FileNotFoundError:
            return QueueState()
        except OSError as e:
            raise QueueFileError(f"the queue file {self.file} cannot be read ({e.strerror})") from None
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not an object")
            return QueueState.from_dict(data)
        except (ValueError, TypeError, KeyError) as e:
            raise QueueFileError(f"the queue file {self.file} is damaged ({e}); move it aside to start an empty "
                                 "queue (its jobs' runs stay in the runs folder beside it)") from None

    @contextlib.contextmanager
    def change(self) -> Iterator[QueueState]:
        """The queue under the lock; what the block leaves in it is written when the block ends without error."""
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _lock(fd)
            state = self.read()
            yield state
            write_text_atomically(self.file, json.dumps(state.to_dict(), indent=1))
            os.chmod(self.file, 0o600)
        finally:
            os.close(fd)  # closing releases the lock

    def take_runner_lock(self) -> int | None:
        """The runner's lock (held for its life: one runner per queue file), or None when another runner holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / RUNNER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        if try_lock(fd):
            return fd
        os.close(fd)
        return None

    def runner_alive(self) -> bool:
        """Whether a runner serves this queue now (asking creates nothing)."""
        try:
            fd = os.open(self.folder / RUNNER_LOCK, os.O_RDWR)
        except FileNotFoundError:
            return False  # no runner ever served it
        try:
            return not try_lock(fd)
        finally:
            os.close(fd)  # a lock taken here to ask is released with it

    def job_folder(self, job_id: int) -> Path:
        """Where a job's config snapshot lives."""
        return self.folder / "jobs" / str(job_id)
