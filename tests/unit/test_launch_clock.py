"""The clocks behind the start-up report's `launch` split (modules/util/launch_clock.py)."""
import json
import os
import subprocess
import sys
import time

import pytest

from modules.util import launch_clock
from tests.trainer_helpers import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process start times come from /proc")


def test_a_process_knows_when_it_started():
    before = time.time()
    code = (f"import sys, time, json; sys.path.insert(0, {str(REPO)!r}); from modules.util import launch_clock; "
            "print(json.dumps([launch_clock.process_start_time(), time.time()]))")
    started, child_now = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                   check=True).stdout)
    assert before - 0.02 <= started <= child_now  # the clock ticks in 10 ms


def test_the_launch_splits_into_the_launcher_starting_the_workers_and_their_imports(monkeypatch):
    mine = launch_clock.process_start_time()
    monkeypatch.setattr(launch_clock, "_marks", {})
    launch_clock.adopt({launch_clock.LAUNCH_TIME: mine - 5.0})
    total, parts = launch_clock.launch_split(mine + 2.0)
    assert total == pytest.approx(7.0, abs=0.02) and parts == {}  # one process: nothing to split
    launch_clock.adopt({launch_clock.WORKERS_STARTED: mine - 1.0})
    total, parts = launch_clock.launch_split(mine + 2.0)
    assert total == pytest.approx(7.0, abs=0.02)
    assert parts == pytest.approx({"launcher's imports and checks": 4.0, "starting the worker processes": 1.0,
                                   "worker's imports": 2.0}, abs=0.02)  # the start read again, to 10 ms
    # The command notes when its imports were done and its checks began: the launcher's part splits too.
    launch_clock.adopt({launch_clock.CHECKS_STARTED: mine - 3.5})
    total, parts = launch_clock.launch_split(mine + 2.0)
    assert parts == pytest.approx({"launcher's imports": 1.5, "launcher's checks": 2.5,
                                   "starting the worker processes": 1.0, "worker's imports": 2.0}, abs=0.02)
    del launch_clock._marks[launch_clock.WORKERS_STARTED]  # one process: its imports, then the config and checks
    total, parts = launch_clock.launch_split(mine + 2.0)
    assert total == pytest.approx(7.0, abs=0.02)
    assert parts == pytest.approx({"imports": 1.5, "config and checks": 5.5}, abs=0.02)
    launch_clock.forget()
    assert launch_clock.launch_split(mine + 2.0) == (None, {})
    assert launch_clock.CHECKS_STARTED not in os.environ


@pytest.mark.parametrize("server_after_workers, expected", [
    (0.5, {"starting the forkserver": 0.5, "the forkserver's imports": 0.5}),
    # Started right after the launcher noted the time, yet read 20 ms before it (start times are read to 10 ms).
    (-0.02, {"starting the forkserver": 0.0, "the forkserver's imports": 1.0}),
    (-30.0, {"starting the worker processes": 1.0}),  # a server kept from an earlier launch
])
def test_workers_forked_from_a_server_started_for_this_launch_count_its_imports_apart(monkeypatch, server_after_workers,
                                                                                     expected):
    mine = launch_clock.process_start_time()
    monkeypatch.setattr(launch_clock, "_marks", {})
    monkeypatch.setattr(launch_clock, "forkserver_start_time", lambda: mine - 1.0 + server_after_workers)
    launch_clock.adopt({launch_clock.LAUNCH_TIME: mine - 5.0, launch_clock.CHECKS_STARTED: mine - 3.5,
                        launch_clock.WORKERS_STARTED: mine - 1.0})
    total, parts = launch_clock.launch_split(mine + 2.0)
    assert parts == pytest.approx({"launcher's imports": 1.5, "launcher's checks": 2.5, **expected,
                                   "worker's imports": 2.0}, abs=0.02)
    assert list(parts)[2:-1] == list(expected)


def test_a_server_started_during_the_checks_leaves_the_wait_for_the_rest_of_its_imports(monkeypatch):
    """The spawn launcher starts the server before its checks (processes.start_forkserver_now): only what
    was left of its imports when the checks ended is part of the launch; a server started otherwise (another
    one, restarted when the workers started) is counted as before."""
    mine = launch_clock.process_start_time()
    monkeypatch.setattr(launch_clock, "_marks", {})
    launch_clock.adopt({launch_clock.LAUNCH_TIME: mine - 5.0, launch_clock.CHECKS_STARTED: mine - 3.5,
                        launch_clock.WORKERS_STARTED: mine - 1.0, launch_clock.FORKSERVER_STARTED: mine - 3.4})
    monkeypatch.setattr(launch_clock, "forkserver_start_time", lambda: mine - 3.4 + 0.01)
    total, parts = launch_clock.launch_split(mine + 2.0)
    assert parts == pytest.approx({"launcher's imports": 1.5, "launcher's checks": 2.5,
                                   "the forkserver's imports left": 1.0, "worker's imports": 2.0}, abs=0.02)
    monkeypatch.setattr(launch_clock, "forkserver_start_time", lambda: mine - 0.5)  # the early one had died
    total, parts = launch_clock.launch_split(mine + 2.0)
    assert parts == pytest.approx({"launcher's imports": 1.5, "launcher's checks": 2.5, "starting the forkserver": 0.5,
                                   "the forkserver's imports": 0.5, "worker's imports": 2.0}, abs=0.02)
