"""Which worker failed first, and how: the one line a user reads when a multi-process run fails.

When one worker dies, the others fail soon after with errors about the lost peer (rank 0: "Connection
reset by peer"), and whatever reports first wins the headline unless someone sorts cause from
consequence. So:
- every worker that raises records its exception and the time (`record_error`, one small JSON file per
  rank in `<workspace>/.tandem/failures/`);
- the launcher notes how each failed process ended as it saw it (`WorkerExit`: exit code or signal);
  spawn watches its processes itself, torchrun's agent reports them (`modules/distributed/agent.py`);
- a rank that ends because of another (its watchdog saw that rank fail or stop answering, `watchdog.py`;
  or rank 0's write failed, `MainRankFailed`) records whom it blames (`record_blame`);
- `first_failure` names the cause: a worker that ended without a Python error (a signal such as
  SIGKILL, a hard exit) comes first, unless a watchdog had already named it as stuck (its end was the
  launcher ending it); then the earliest error that is not about another rank (a lost connection, a
  timeout waiting for it, being stopped); then the earliest blame; then the earliest of the rest.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from modules.util.atomic import write_text_atomically
from modules.util.no_follow import open_text_no_follow

SECONDARY_KINDS = ("DistBackendError", "DistNetworkError", "DistStoreError", "KeyboardInterrupt", "SystemExit",
                   "MainRankFailed")
"""Exception types that follow from another rank's failure (or from being stopped)."""
SECONDARY_WORDS = ("connection reset", "connection closed", "broken pipe", "connection refused", "by peer",
                   "remote process", "timed out", "timeout", "communicator was aborted", "socket")
"""Words of errors about a lost peer, in gloo's and NCCL's messages (which are plain RuntimeErrors)."""
RESTART_COUNT_VARIABLE = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchrun's agent for its workers: how often it has restarted them."""
MAX_RESTARTS_VARIABLE = "TORCHELASTIC_MAX_RESTARTS"
ENDED_BY_WATCHDOG = 3
"""Exit code of a worker that its watchdog ended because of another rank (its note names that rank)."""


@dataclass(frozen=True)
class WorkerExit:
    """How a worker process ended, as its launcher saw it."""

    rank: int
    exitcode: int
    """Negative: killed by that signal (the subprocess convention)."""
    seen_at: float
    attempt: int = 0
    """Which round of workers (0: the first; torchrun's agent counts its restarts)."""

    def how(self) -> str:
        if self.exitcode >= 0:
            return f"exit code {self.exitcode}"
        try:
            return f"signal {signal.Signals(-self.exitcode).name}"
        except ValueError:
            return f"signal {-self.exitcode}"


def read_exits(exits_file: Path) -> list[WorkerExit]:
    """Every failed round's exits as torchrun's agent noted them (`agent.py`; not its notes about the
    rendezvous)."""
    try:
        return [WorkerExit(**entry) for entry in json.loads(exits_file.read_text(encoding="utf-8")) if "rank" in entry]
    except (OSError, ValueError, TypeError):
        return []


@dataclass(frozen=True)
class WorkerError:
    """An exception a worker raised, as it recorded it."""

    rank: int
    time: float
    kind: str
    text: str
    secondary: bool
    """Whether it follows from another rank's failure (see SECONDARY_KINDS / SECONDARY_WORDS)."""
    attempt: int = 0
    """Which round of workers raised it (`TORCHELASTIC_RESTART_COUNT`)."""
    step: int | None = None
    """The training step the rank had reached (for a blame: the blamed rank's); None before training started."""
    blames: int | None = None
    """The rank this one ended because of (its watchdog's verdict, or the rank `MainRankFailed` names)."""
    phase: str | None = None
    """What the rank (for a blame: the blamed rank) was doing: `training step`, `loading a batch`, ..."""

    def describe(self) -> str:
        return f"{self.kind}: {self.text}" if self.text else self.kind

    def where(self) -> str:
        """" at step 7 (loading a batch)", or less where less is known."""
        at = f" at step {self.step}" if self.step else ""
        return f"{at} ({self.phase})" if self.phase else at


@dataclass(frozen=True)
class Failure:
    rank: int | None
    text: str
    where: str = ""
    """Where the rank was when it failed ("step 24, loading a batch"), when its text does not say it."""


PRIMARY_KINDS = ("DataLoadingError", "NonFiniteTrainingError", "MemoryLimitExceeded")
"""Exception types about this rank's own trouble, whatever words their text holds."""


def is_secondary(kind: str, text: str) -> bool:
    if kind in PRIMARY_KINDS:
        return False
    lowered = text.lower()
    return kind in SECONDARY_KINDS or any(word in lowered for word in SECONDARY_WORDS)


def failures_folder(workspace: Path) -> Path:
    return Path(workspace) / ".tandem" / "failures"


def clear(folder: Path) -> None:
    """Forget an earlier run's records (the launcher calls this before starting workers)."""
    folder = Path(folder)
    if folder.is_dir():
        for old in [*folder.glob("rank-*.json"), *folder.glob("rank-*.log")]:
            old.unlink(missing_ok=True)


def current_attempt() -> int:
    """This worker's round: how often torchrun's agent has restarted the workers (0 outside torchrun)."""
    return int(os.environ.get(RESTART_COUNT_VARIABLE, "0") or 0)


def blamed_rank(kind: str, text: str) -> int | None:
    """The rank an error names as the one that failed (`MainRankFailed`: "rank 0 failed: ...")."""
    found = re.match(r"rank (\d+) failed: ", text) if kind == "MainRankFailed" else None
    return int(found.group(1)) if found else None


def record_error(folder: Path, rank: int, error: BaseException, step: int | None = None,
                 phase: str | None = None) -> None:
    """Note this rank's exception for the launcher, and its traceback in `details_file` (the console gets one
    line: the launcher's headline names that file). Never raises: the error being handled matters more."""
    kind, text = type(error).__name__, " ".join(str(error).split())[:2000]
    _write(folder, WorkerError(rank, time.time(), kind, text, is_secondary(kind, text), current_attempt(), step,
                               blamed_rank(kind, text), phase))
    try:
        details = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        where = f"rank {rank}" + (f", step {step}" if step else "") + (f", {phase}" if phase else "")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with open_text_no_follow(details_file(folder, rank), "a") as f:
            f.write(f"--- {stamp}, {where}, round {current_attempt()}\n{details}\n")
    except BaseException:  # noqa: BLE001 - also a signal handler's error (a loader's SIGCHLD) raised meanwhile
        pass


def details_file(folder: Path, rank: int) -> Path:
    """Where a rank's tracebacks go (one per failed round of workers, appended)."""
    return Path(folder) / f"rank-{rank}.log"


def with_details(failure: Failure, folder: Path) -> Failure:
    """`failure` with the file that holds its rank's traceback named, when there is one."""
    parts = [failure.where] if failure.where else []
    if failure.rank is not None and details_file(folder, failure.rank).is_file():
        parts.append(f"details: {details_file(folder, failure.rank)}")
    if not parts:
        return failure
    return Failure(failure.rank, f"{failure.text.rstrip('.')} ({'; '.join(parts)}).", failure.where)


def record_blame(folder: Path, rank: int, blamed: int, text: str, step: int | None, phase: str | None,
                 kind: str = "EndedByWatchdog") -> None:
    """Note that this rank ended because of rank `blamed` (`text`: why, as a headline says it: "rank 1 stopped
    answering: ..."); `step` and `phase`: where the blamed rank was."""
    _write(folder, WorkerError(rank, time.time(), kind, text, True, current_attempt(), step, blamed, phase))


def recorded(folder: Path, rank: int) -> bool:
    """Whether this rank has noted an error of this round already (its first note is the one that counts)."""
    entry = read_errors(folder, current_attempt()).get(rank)
    return entry is not None


def _write(folder: Path, entry: WorkerError) -> None:
    rank = entry.rank
    try:
        # A unique temporary file (a fixed name could be a planted link), renamed in one step.
        write_text_atomically(Path(folder) / f"rank-{rank}.json", json.dumps(asdict(entry)))
    except OSError:
        pass


def read_errors(folder: Path, attempt: int | None = None) -> dict[int, WorkerError]:
    """The recorded errors by rank; of one round of workers when `attempt` is given."""
    found = {}
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            entry = WorkerError(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            continue
        if attempt is None or entry.attempt == attempt:
            found[entry.rank] = entry
    return found


def last_round(exits: list[WorkerExit]) -> list[WorkerExit]:
    """The exits of the last failed round (earlier rounds were restarted)."""
    if not exits:
        return []
    last = max(e.attempt for e in exits)
    return [e for e in exits if e.attempt == last]


def round_cause(exits: list[WorkerExit], errors: dict[int, WorkerError], world_size: int,
                timeout_minutes: float) -> str:
    """What ended a round of workers, in a few words: "rank 1 died (SIGKILL)", "rank 0 failed (ValueError: ...)",
    "rank 1 stopped answering (...)" when a watchdog named it or the others timed out waiting for it, or
    "ranks 2, 3 were lost (...)" when the others lost their connection to ranks that this machine did not see
    end (another machine)."""
    recorded = list(errors.values())
    first = first_failure(exits, errors)
    blame = _first_blame(exits, errors)
    if blame is not None and (first.rank == blame.blames and first.rank not in errors):
        return blame.text
    if recorded and all(e.secondary for e in recorded) and blame is None:
        # Every rank that spoke was waiting for, or lost, another: the cause is a rank that said nothing.
        timed_out = all("timed out" in e.text.lower() or "timeout" in e.text.lower() for e in recorded)
        gave_up = min(e.time for e in recorded)
        ended = {e.rank: e for e in exits if e.rank not in errors and e.exitcode != 0}
        # After a timeout, a rank that ended later was ended by torchrun's agent: it had hung, not died.
        died = sorted((e for e in ended.values() if not timed_out or e.seen_at < gave_up), key=lambda e: e.seen_at)
        if died:
            return f"rank {died[0].rank} died ({died[0].how().replace('signal ', '')})"
        quiet = [r for r in range(world_size) if r not in errors]
        who = (f"rank {quiet[0]}" if len(quiet) == 1 else f"ranks {', '.join(map(str, quiet))}") if quiet else "a rank"
        if timed_out:
            return (f"{who} stopped answering (a collective timed out after multi_gpu.timeout_minutes = "
                    f"{timeout_minutes:g})")
        return f"{who} {'was' if len(quiet) == 1 else 'were'} lost (the connection closed: their machine or processes ended)"
    silent = [e for e in exits if e.exitcode != 0 and e.rank not in errors and e.rank == first.rank]
    if silent:
        return f"rank {first.rank} died ({silent[0].how().replace('signal ', '')})"
    if first.rank is not None and first.rank in errors and not errors[first.rank].secondary:
        error = errors[first.rank]
        text = error.describe()
        return f"rank {first.rank} failed ({text[:200]}{'...' if len(text) > 200 else ''})"
    if blame is not None:
        return blame.text
    return first.text.rstrip(".")


def restart_line(restart: int, max_restarts: int, cause: str, failed_step: int | None,
                 resumed_step: int | None) -> str:
    """"restart 1 of 3: rank 1 died (SIGKILL) at step 431; resuming from the backup at step 400"."""
    at = f" at step {failed_step}" if failed_step else " before training started"
    then = (f"resuming from the backup at step {resumed_step}" if resumed_step is not None
            else "no backup of this run yet: starting again from the beginning")
    return f"restart {restart} of {max_restarts}: {cause}{at}; {then}"


def first_failure(exits: list[WorkerExit], errors: dict[int, WorkerError],
                  positions: dict[int, tuple[int, str]] | None = None) -> Failure:
    """The rank that failed first and how, as one sentence (see the module docstring for the rules);
    `positions`: each rank's last (step, phase) as its watchdog published it, for a rank that said nothing."""
    silent = sorted((e for e in exits if e.exitcode != 0 and e.rank not in errors), key=lambda e: e.seen_at)
    blame = _first_blame(exits, errors)
    if silent and not (blame is not None and blame.blames == silent[0].rank and blame.time <= silent[0].seen_at):
        first = silent[0]
        hint = " - killed from outside, or by the system for lack of memory" if first.exitcode == -9 else ""
        where = _where(first.rank, errors, positions or {})
        return Failure(first.rank, f"rank {first.rank} died first ({first.how()}{hint}){where}; the other ranks "
                                   "stopped because of it.")
    primary = sorted((e for e in errors.values() if not e.secondary), key=lambda e: e.time)
    if primary:
        first = primary[0]
        where = ", ".join(filter(None, [f"at step {first.step}" if first.step else "", first.phase or ""]))
        return Failure(first.rank, f"rank {first.rank} failed first: {first.describe()}{advice(first)}", where)
    if blame is not None:
        own = errors.get(blame.blames)
        if own is not None and own.blames is None and own.kind not in ("KeyboardInterrupt", "SystemExit"):
            return Failure(own.rank, f"rank {own.rank} failed first: {own.describe()}")
        if blame.kind == "MainRankFailed":  # "rank 0 failed: OSError: ..." - rank 0 had no time to note it
            return Failure(blame.blames, blame.text.replace(" failed: ", " failed first: ", 1))
        return Failure(blame.blames, f"{blame.text}{blame.where()}; the other ranks ended because of it.")
    secondary = sorted(errors.values(), key=lambda e: e.time)
    if secondary:
        first = secondary[0]
        return Failure(first.rank, f"rank {first.rank} failed first: {first.describe()}")
    failed = sorted((e for e in exits if e.exitcode != 0), key=lambda e: e.seen_at)
    if failed:
        return Failure(failed[0].rank, f"rank {failed[0].rank} failed first ({failed[0].how()}).")
    return Failure(None, "a worker failed; its rank is not known (see the log above).")


def advice(error: WorkerError) -> str:
    """What a user can do about an error whose text does not say it."""
    killed = ("Killed" in error.text or "signal: 9" in error.text or "SIGKILL" in error.text)
    if killed and ("DataLoader worker" in error.text or "data loading worker" in error.text):
        return (f"{'' if error.text.endswith('.') else '.'} It was killed from outside, or by the system for lack of "
                "memory: lower data.num_workers (it is per rank), or cache the latents")
    return ""


def _first_blame(exits: list[WorkerExit], errors: dict[int, WorkerError]) -> WorkerError | None:
    """The earliest record of a rank that ended because of another one."""
    blames = sorted((e for e in errors.values() if e.blames is not None), key=lambda e: e.time)
    return blames[0] if blames else None


def _where(rank: int, errors: dict[int, WorkerError], positions: dict[int, tuple[int, str]]) -> str:
    """Where a rank that died without a word was, as a watchdog last saw it (" at step 24 (training step)")."""
    seen = [e for e in errors.values() if e.blames == rank and e.step]
    if seen:
        return f" at step {seen[0].step}"
    step, phase = positions.get(rank, (0, ""))
    return f" at step {step} ({phase})" if step else ""
