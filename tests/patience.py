"""How long a test waits before it calls something a hang.

A limit in a test detects a hang; it does not check speed. The same suite runs on an idle CI machine and on a
laptop whose cores are busy with other work (load 8-46 on 2 cores was seen, and every launched process then
took several times as long), so each limit is the time the waited-for thing takes on a quiet machine times how
much slower this machine is now. The waits themselves end as soon as the event happens: only a real hang pays
the longer limit.

`TANDEM_TEST_SLOWNESS` sets the factor by hand (e.g. 10 under a debugger, or on a machine known to be slow).
"""
from __future__ import annotations

import os

MOST = 20.0
"""A factor above this is no longer a busy machine but a stuck one; a hang should still end the test."""


def slowness() -> float:
    """How many times slower than an idle machine this one runs now: the runnable processes per core over the
    last minute, at least what the suite's own workers will add (`suite_load`), or `TANDEM_TEST_SLOWNESS`."""
    chosen = os.environ.get("TANDEM_TEST_SLOWNESS")
    if chosen:
        return max(1.0, float(chosen))
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average (Windows): only the hand-set factor scales
        per_core = 1.0
    return min(MOST, max(1.0, per_core, suite_load()))


def suite_load() -> float:
    """The load the suite itself puts on the cores while it runs in pytest-xdist workers: each worker's test
    and the two or three processes it often launches. A minute's load average lags behind it: the first tests
    of a run start on a quiet machine and are the heaviest (slowest first)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return 2.0 * workers / (os.cpu_count() or 1) if workers > 1 else 1.0


def patience(seconds: float) -> float:
    """`seconds` - enough on an idle machine - scaled to this machine's load now."""
    return seconds * slowness()
