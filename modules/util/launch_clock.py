"""When a run's processes started: the clocks behind the start-up report's `launch` split.

The user's command notes when it started (`TANDEM_LAUNCH_TIME`, inherited by every worker); a
multi-process launcher notes when it began starting the workers (`TANDEM_WORKERS_STARTED`); a worker
knows when its own process started; the command also notes when it had imported what it needs and began
reading the config and checking the job (`TANDEM_CHECKS_STARTED`). From them, the time before a worker's
trainer begins splits into the launcher's imports, the launcher's checks, starting the worker processes,
and the worker's imports; in one process into the imports and the config and checks.
"""
from __future__ import annotations

import os
import time

LAUNCH_TIME = "TANDEM_LAUNCH_TIME"
"""When the user's command started (seconds since the epoch), inherited by every worker: start-up is
reported from it, so the time spent starting processes and importing libraries is not hidden."""

WORKERS_STARTED = "TANDEM_WORKERS_STARTED"
"""When a multi-process launcher began starting its workers (seconds since the epoch)."""

CHECKS_STARTED = "TANDEM_CHECKS_STARTED"
"""When the user's command had imported what it needs and began reading the config and checking the job
(seconds since the epoch): the launcher's own time before it starts workers (6-9 s on H100 hosts, 1.6 s
on a 2-core machine) splits into its imports and its checks."""


def process_start_time() -> float | None:
    """When this process started (seconds since the epoch), to 10 ms; None where /proc does not tell (not Linux)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
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
    os.environ.setdefault(LAUNCH_TIME, repr(process_start_time() or time.time()))


def note_checks_start() -> None:
    """The user's command has its libraries and begins reading the config and checking the job."""
    os.environ.setdefault(CHECKS_STARTED, repr(time.time()))


def forget_launch_times() -> None:
    """A restarted round: the user's command (and the first round's workers) started long before it."""
    for name in (LAUNCH_TIME, WORKERS_STARTED, CHECKS_STARTED):
        os.environ.pop(name, None)


def launch_split(now: float) -> tuple[float | None, dict[str, float]]:
    """(seconds from the user's command to `now`, or None when unknown; its parts) for this process."""
    launched = os.environ.get(LAUNCH_TIME)
    if not launched:
        return None, {}
    launched_at = float(launched)
    total = max(0.0, now - launched_at)
    checks = os.environ.get(CHECKS_STARTED)
    checks_at = min(max(float(checks), launched_at), now) if checks else None
    workers = os.environ.get(WORKERS_STARTED)
    mine = process_start_time()
    if not workers or mine is None:  # one process
        return total, ({} if checks_at is None else {"imports": checks_at - launched_at,
                                                     "config and checks": now - checks_at})
    workers_at = float(workers)
    mine = max(mine, workers_at)  # clocks read to 10 ms: never a negative part
    launcher = ({"launcher's imports and checks": max(0.0, workers_at - launched_at)} if checks_at is None else
                {"launcher's imports": checks_at - launched_at, "launcher's checks": max(0.0, workers_at - checks_at)})
    return total, {**launcher, "starting the worker processes": mine - workers_at,
                   "worker's imports": max(0.0, now - mine)}
