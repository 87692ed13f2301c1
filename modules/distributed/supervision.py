"""What a launcher does while its workers run: turn signals into a clean stop, and watch the processes.

Signals. Ctrl-C, `kill -INT` and SIGTERM (what job schedulers send) reach the launcher, not always the
workers (torchrun runs in its own session; `kill` names one process), and a launcher started with
SIGINT ignored (`nohup ... &`) would otherwise never see them. `StopSignals` installs its own handlers
whatever was inherited: the first signal writes `stop` to the commands file, so every rank stops at
the same step and writes a backup; the second ends the workers (SIGTERM), the third kills them.

Processes (spawn). `watch` waits until every worker has exited or one has failed; it notes how each
failed process ended at that moment (the first failures, for `failures.first_failure`), gives the
others a few seconds to end by themselves, then terminates and finally kills what is left.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import time
from pathlib import Path
from typing import Callable

from modules.distributed.failures import ENDED_BY_WATCHDOG, WorkerExit
from modules.util.exit import die_with_parent
from modules.util.run_protocol import write_command

log = logging.getLogger("tandem")
HARD_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)  # Windows has no SIGKILL
STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGBREAK", None)) if s is not None)
SELF_EXIT_GRACE_S = 5.0
"""After one worker failed, how long the others get to notice and exit by themselves."""
TERMINATE_GRACE_S = 10.0
"""How long a worker gets to exit after SIGTERM before it is killed."""
WATCHDOG_EXIT_GRACE_S = 3.0
"""After a watchdog ended a worker, how long the others get before they are killed."""


class StopSignals:
    """While active: 1st SIGINT/SIGTERM -> `stop` for every rank (with a backup); 2nd -> `abort(SIGTERM)`;
    3rd and later -> `abort(SIGKILL)`."""

    def __init__(self, commands_file: Path, abort: Callable[[int], None] | None = None):
        self.commands_file = Path(commands_file)
        self.abort = abort
        self.received = 0
        self._previous: dict[int, object] = {}

    def attach(self, abort: Callable[[int], None]) -> None:
        """What ends the workers, once they exist (an abort asked for while they started applies now)."""
        self.abort = abort
        if self.aborted:
            abort(signal.SIGTERM if self.received == 2 else HARD_KILL)

    @property
    def aborted(self) -> bool:
        return self.received > 1

    def __enter__(self) -> "StopSignals":
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def _handle(self, signum, frame) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        if self.received == 1:
            write_command(self.commands_file, "stop")
            log.info("%s: stopping every rank at the next step (with a backup); send it again to abort.", name)
        elif self.received == 2:
            log.warning("%s again: ending the workers now (no backup).", name)
            if self.abort is not None:
                self.abort(signal.SIGTERM)
        elif self.abort is not None:
            self.abort(HARD_KILL)


def end_with_parent(parent_pid: int | None = None) -> None:
    """Have the system kill this worker when the process that started it ends (Linux; elsewhere the workers'
    watchdog notices that their launcher's store is gone). A worker must not write on after its launcher was
    killed: the workspace would look free to a new run. `parent_pid`: the parent it must still have (it may
    have ended before this was asked for)."""
    die_with_parent(parent_pid)


def signal_processes(processes, signum: int) -> None:
    for process in processes:
        if process.is_alive():
            try:
                os.kill(process.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass


def watch(processes: list, poll_s: float = 0.5) -> list[WorkerExit]:
    """Wait for `processes` (multiprocessing, index = rank) to end; the failures seen first, if any."""
    running = dict(enumerate(processes))
    while running:
        multiprocessing.connection.wait([p.sentinel for p in running.values()], timeout=poll_s)
        now = time.time()
        ended = {rank: p for rank, p in running.items() if p.exitcode is not None}
        for rank in ended:
            del running[rank]
        failed = [WorkerExit(rank, p.exitcode, now) for rank, p in ended.items() if p.exitcode != 0]
        if failed:
            _end_the_rest(list(running.values()), quick=any(e.exitcode == ENDED_BY_WATCHDOG for e in failed))
            return failed
    return []


def _end_the_rest(processes: list, quick: bool = False) -> None:
    """`quick`: a watchdog ended a worker because of another one - the healthy ones leave by themselves within
    a beat or two, and the one it named is frozen or stuck and would not act on SIGTERM."""
    if quick:
        _join_all(processes, WATCHDOG_EXIT_GRACE_S)
        signal_processes(processes, HARD_KILL)
        _join_all(processes, None)
        return
    _join_all(processes, SELF_EXIT_GRACE_S)
    signal_processes(processes, signal.SIGTERM)
    _join_all(processes, TERMINATE_GRACE_S)
    signal_processes(processes, HARD_KILL)
    _join_all(processes, None)


def _join_all(processes: list, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    for process in processes:
        process.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
