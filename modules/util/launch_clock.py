"""When a run's processes started: the clocks behind the start-up report's `launch` split.

The user's command notes when it started (`note_launch_time`: its process's start, so its imports count)
and when it had imported what it needs and began reading the config and checking the job
(`note_checks_start`); a multi-process launcher adds when it began starting the workers and hands all three
to its workers in their job (`marks` -> `adopt`); a worker knows when its own process started. From them,
the time before a worker's trainer begins splits into the launcher's imports, the launcher's checks,
starting the worker processes (with the spawn launcher's forkserver: starting the server and its imports,
which every worker inherits; or, with the server started during the checks, what was left of its imports
when they ended), and the worker's imports; in one process into the imports and the config
and checks. The marks live in this process only: nothing travels in the environment.
"""
from __future__ import annotations

import os
import time

LAUNCH_TIME = "launch"
"""When the user's command started (seconds since the epoch): start-up is reported from it, so the time
spent starting processes and importing libraries is not hidden."""
WORKERS_STARTED = "workers"
"""When a multi-process launcher began starting its workers (seconds since the epoch)."""
CHECKS_STARTED = "checks"
"""When the user's command had imported what it needs and began reading the config and checking the job
(seconds since the epoch): the launcher's own time before it starts workers (6-9 s on H100 hosts, 1.6 s
on a 2-core machine) splits into its imports and its checks."""

FORKSERVER_STARTED = "forkserver"
"""When the spawn launcher started its workers' forkserver during its checks (seconds since the epoch), so its
imports ran beside them (`processes.start_forkserver_now`)."""

PROCESS_CLOCK_SLACK = 0.05
"""Seconds two process start times may be off from each other and from `time.time()` (each read to 10 ms)."""

_marks: dict[str, float] = {}


def process_start_time(pid: str = "self") -> float | None:
    """When process `pid` (default: this one) started (seconds since the epoch), to 10 ms; None where /proc does
    not tell (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            # The command name (in parentheses) may hold spaces: the fields counted from after it.
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        started_after_boot = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5): starttime
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - (uptime - started_after_boot)


def note_launch_time() -> None:
    """The user's command starts the clock: from its process's start where known (its imports count)."""
    _marks.setdefault(LAUNCH_TIME, process_start_time() or time.time())


def note_checks_start() -> None:
    """The user's command has its libraries and begins reading the config and checking the job."""
    _marks.setdefault(CHECKS_STARTED, time.time())


def note_forkserver_started(at: float) -> None:
    """The launcher started its workers' forkserver at `at` (just before its fork), before checking the job."""
    _marks[FORKSERVER_STARTED] = at


def marks(workers_started: float | None = None) -> dict[str, float]:
    """This process's marks, for its workers' job; `workers_started`: when the launcher starts them."""
    found = dict(_marks)
    if workers_started is not None:
        found[WORKERS_STARTED] = workers_started
    return found


def adopt(given: dict[str, float]) -> None:
    """A worker takes its launcher's marks (from its job)."""
    _marks.update({k: float(v) for k, v in given.items() if k in (LAUNCH_TIME, WORKERS_STARTED, CHECKS_STARTED,
                                                                        FORKSERVER_STARTED)})


def forget() -> None:
    """A restarted round: the user's command (and the first round's workers) started long before it."""
    _marks.clear()


def launch_split(now: float) -> tuple[float | None, dict[str, float]]:
    """(seconds from the user's command to `now`, or None when unknown; its parts) for this process."""
    launched_at = _marks.get(LAUNCH_TIME)
    if launched_at is None:
        return None, {}
    total = max(0.0, now - launched_at)
    checks = _marks.get(CHECKS_STARTED)
    checks_at = min(max(checks, launched_at), now) if checks is not None else None
    workers_at = _marks.get(WORKERS_STARTED)
    mine = process_start_time()
    if workers_at is None or mine is None:  # one process
        return total, ({} if checks_at is None else {"imports": checks_at - launched_at,
                                                     "config and checks": now - checks_at})
    mine = max(mine, workers_at)  # clocks read to 10 ms: never a negative part
    launcher = ({"launcher's imports and checks": max(0.0, workers_at - launched_at)} if checks_at is None else
                {"launcher's imports": checks_at - launched_at, "launcher's checks": max(0.0, workers_at - checks_at)})
    server = forkserver_start_time()
    started_early = _marks.get(FORKSERVER_STARTED)
    # Process start times are read to 10 ms and computed from the uptime: a server started right after the
    # launcher noted `workers_at` may read a little before it. One kept from an earlier launch started seconds before.
    # Its fork comes right after the launcher notes the time; a second allows for a busy machine.
    early = (server is not None and started_early is not None
             and started_early - PROCESS_CLOCK_SLACK <= server <= started_early + 1)
    if early:
        # Started during the launcher's checks: its imports ran beside them, and what was left of them when the
        # checks ended is this wait.
        starting = {"the forkserver's imports left": mine - workers_at}
    elif server is not None and workers_at - PROCESS_CLOCK_SLACK <= server <= mine + PROCESS_CLOCK_SLACK:
        # The spawn launcher's workers are forked from a server started for this launch, once it has imported
        # what every worker needs (`processes.PRELOADED`): its imports are the workers' imports, paid once.
        server = min(max(server, workers_at), mine)
        starting = {"starting the forkserver": server - workers_at, "the forkserver's imports": mine - server}
    else:
        starting = {"starting the worker processes": mine - workers_at}
    return total, {**launcher, **starting, "worker's imports": max(0.0, now - mine)}


def forkserver_start_time() -> float | None:
    """When this process's parent started, where that parent is multiprocessing's forkserver; else None."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            if b"multiprocessing.forkserver" not in f.read():
                return None
    except OSError:
        return None
    return process_start_time(str(parent))
