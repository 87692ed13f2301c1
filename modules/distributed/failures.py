"""Which worker failed first, and how: the one line a user reads when a multi-process run fails.

When one worker dies, the others fail soon after with errors about the lost peer (rank 0: "Connection
reset by peer"), and whatever reports first wins the headline unless someone sorts cause from
consequence. So:
- every worker that raises records its exception and the time (`record_error`, one small JSON file per
  rank in `<workspace>/.tandem/failures/`);
- the launcher notes how each failed process ended as it saw it (`WorkerExit`: exit code or signal);
  spawn watches its processes itself, torchrun's agent reports them (`modules/distributed/agent.py`);
- `first_failure` names the cause: a worker that ended without a Python error (a signal such as
  SIGKILL, a hard exit) comes first; then the earliest error that is not about another rank (a lost
  connection, a timeout waiting for it, being stopped); then the earliest of those.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SECONDARY_KINDS = ("DistBackendError", "DistNetworkError", "DistStoreError", "KeyboardInterrupt", "SystemExit")
"""Exception types that follow from another rank's failure (or from being stopped)."""
SECONDARY_WORDS = ("connection reset", "connection closed", "broken pipe", "connection refused", "by peer",
                   "remote process", "timed out", "timeout", "communicator was aborted", "socket")
"""Words of errors about a lost peer, in gloo's and NCCL's messages (which are plain RuntimeErrors)."""


@dataclass(frozen=True)
class WorkerExit:
    """How a worker process ended, as its launcher saw it."""

    rank: int
    exitcode: int
    """Negative: killed by that signal (the subprocess convention)."""
    seen_at: float

    def how(self) -> str:
        if self.exitcode >= 0:
            return f"exit code {self.exitcode}"
        try:
            return f"signal {signal.Signals(-self.exitcode).name}"
        except ValueError:
            return f"signal {-self.exitcode}"


@dataclass(frozen=True)
class WorkerError:
    """An exception a worker raised, as it recorded it."""

    rank: int
    time: float
    kind: str
    text: str
    secondary: bool
    """Whether it follows from another rank's failure (see SECONDARY_KINDS / SECONDARY_WORDS)."""

    def describe(self) -> str:
        return f"{self.kind}: {self.text}" if self.text else self.kind


@dataclass(frozen=True)
class Failure:
    rank: int | None
    text: str


def is_secondary(kind: str, text: str) -> bool:
    lowered = text.lower()
    return kind in SECONDARY_KINDS or any(word in lowered for word in SECONDARY_WORDS)


def failures_folder(workspace: Path) -> Path:
    return Path(workspace) / ".tandem" / "failures"


def clear(folder: Path) -> None:
    """Forget an earlier run's records (the launcher calls this before starting workers)."""
    folder = Path(folder)
    if folder.is_dir():
        for old in folder.glob("rank-*.json"):
            old.unlink(missing_ok=True)


def record_error(folder: Path, rank: int, error: BaseException) -> None:
    """Note this rank's exception for the launcher. Never raises: the error being handled matters more."""
    kind, text = type(error).__name__, " ".join(str(error).split())[:2000]
    entry = WorkerError(rank, time.time(), kind, text, is_secondary(kind, text))
    try:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".rank-{rank}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(asdict(entry)), encoding="utf-8")
        os.replace(tmp, folder / f"rank-{rank}.json")
    except OSError:
        pass


def read_errors(folder: Path) -> dict[int, WorkerError]:
    found = {}
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            entry = WorkerError(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            continue
        found[entry.rank] = entry
    return found


def first_failure(exits: list[WorkerExit], errors: dict[int, WorkerError]) -> Failure:
    """The rank that failed first and how, as one sentence (see the module docstring for the rules)."""
    silent = sorted((e for e in exits if e.exitcode != 0 and e.rank not in errors), key=lambda e: e.seen_at)
    if silent:
        first = silent[0]
        hint = " - killed from outside, or by the system for lack of memory" if first.exitcode == -9 else ""
        return Failure(first.rank, f"rank {first.rank} died first ({first.how()}{hint}); the other ranks "
                                   "stopped because of it.")
    for secondary in (False, True):
        candidates = sorted((e for e in errors.values() if e.secondary == secondary), key=lambda e: e.time)
        if candidates:
            first = candidates[0]
            return Failure(first.rank, f"rank {first.rank} failed first: {first.describe()}")
    failed = sorted((e for e in exits if e.exitcode != 0), key=lambda e: e.seen_at)
    if failed:
        return Failure(failed[0].rank, f"rank {failed[0].rank} failed first ({failed[0].how()}).")
    return Failure(None, "a worker failed; its rank is not known (see the log above).")
