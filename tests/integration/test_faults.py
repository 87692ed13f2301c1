"""Faults under the real launchers, on 2 CPU processes over gloo: a killed DataLoader worker and a stuck one end
the job within seconds, naming the rank and where it was, with one headline and no traceback. (A killed and
a frozen rank under restarts: tests/unit/test_elastic.py; the watchdog's rules without processes: test_watchdog.py.)"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from modules.benchmark.fault_trials import _alive, _descendants, _ranks
from modules.util.run_protocol import parse_event_line
from tests.trainer_helpers import launcher_flag, overrides_for, start_script
from tests.patience import patience

NOISE = ("Traceback", "ChildFailedError", "Root Cause", "[rank0]:", "[rank1]:", "TCPStore", "socket.cpp")
"""What a failure printed above Tandem's headline under torchrun (and must not)."""


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


class Run:
    """A launched 2-process training whose output is read on a thread (a stopped loader worker keeps the pipe
    open after the job ended, so its end is the launcher's exit, not the end of the output)."""

    def __init__(self, workspace: Path, cache: Path, launcher: str, *extra: str):
        self.proc = start_script("train_multi_gpu.py", "--config-path", "#demo", "--device", "cpu", "--num-gpus", "2",
                                 *launcher_flag(launcher),
                                 *overrides_for(workspace, cache, "training.max_steps=100000", "data.num_workers=1",
                                                "multi_gpu.timeout_minutes=5", *extra), start_new_session=True)
        self.lines: list[str] = []
        self.step = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.family: set[int] = set()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.step:
                self.lines.append(line)
                self.step.notify_all()

    def wait_for_step(self, step: int, timeout: float = 600) -> None:
        def reached() -> bool:
            return any((e := parse_event_line(line)) and e["type"] == "progress" and e["step"] >= step
                       for line in self.lines)
        with self.step:
            assert self.step.wait_for(lambda: reached() or self.proc.poll() is not None, patience(timeout)), self.output()
        assert reached(), self.output()
        self.family.update(_descendants(self.proc.pid))

    def rank_and_its_loader(self, rank: int) -> tuple[int, int]:
        ranks = sorted(_ranks(self.proc.pid))  # started in rank order
        (loader,) = _descendants(ranks[rank])
        return ranks[rank], loader

    def finish(self, timeout: float = 300) -> tuple[int, float]:
        started = time.monotonic()
        try:
            code = self.proc.wait(timeout=patience(timeout))
        finally:
            for pid in _alive(sorted(self.family | set(_descendants(self.proc.pid)))):
                os.kill(pid, signal.SIGKILL)  # what the test stopped is the test's to end
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.reader.join(10)
        return code, time.monotonic() - started

    def output(self) -> str:
        return "".join(self.lines)

    def headline(self) -> str:
        (line,) = [line for line in self.output().splitlines() if line.startswith("Training failed: ")]
        return line[len("Training failed: "):]


@pytest.mark.slow
def test_a_killed_loader_worker_ends_the_job_at_once_naming_its_rank(tmp_path, cache_dir):
    """kill -9 of a DataLoader worker of rank 1 (what the OOM killer does): on GPUs the job sat out
    timeout_minutes and then named rank 0. It must end within seconds, one headline naming rank 1, no tracebacks.
    Under torchrun, whose agent prints tracebacks above a failure: the rank notes its loader's death itself
    (modules/distributed/failures.py), whichever launcher started it, and the spawn launcher's end of a job
    whose rank failed is tests/integration/test_launch_safety.py's killed-rank test. With restarts: tests/unit/test_elastic.py."""
    ws = tmp_path / "ws"
    run = Run(ws, cache_dir, "torchrun")
    run.wait_for_step(3)
    _, loader = run.rank_and_its_loader(1)
    os.kill(loader, signal.SIGKILL)
    code, took = run.finish()
    output = run.output()
    assert code == 1, output[-3000:]
    assert took < patience(30), f"the job ended {took:.0f} s after the loader worker died"
    headline = run.headline()
    assert headline.startswith("rank 1 failed first: ") and str(loader) in headline, headline
    assert "lack of memory" in headline and "data.num_workers" in headline
    details = ws / ".tandem" / "failures" / "rank-1.log"
    assert "at step " in headline and headline.endswith(f"; details: {details}).") and "Traceback" in details.read_text()
    assert not [word for word in NOISE if word in output], output[-3000:]


@pytest.mark.slow
def test_a_stuck_loader_worker_is_named_with_the_step_and_phase_it_stuck_in(tmp_path, cache_dir):
    """A loader worker that stops (SIGSTOP: a read hung on a network drive): rank 1 waits for its batch, rank 0 for
    rank 1. The watchdogs name rank 1 after multi_gpu.stall_seconds, not timeout_minutes (5 here)."""
    stall_s = 10
    run = Run(tmp_path / "ws", cache_dir, "spawn", f"multi_gpu.stall_seconds={stall_s}")
    run.wait_for_step(3)
    _, loader = run.rank_and_its_loader(1)
    os.kill(loader, signal.SIGSTOP)
    stopped = time.monotonic()
    code, _ = run.finish()
    took = time.monotonic() - stopped
    assert code == 1, run.output()[-3000:]
    headline = run.headline()
    assert headline.startswith("rank 1 stopped making progress (the others waited "), headline
    assert "(loading a batch); the other ranks ended because of it." in headline, headline
    # the stall time (longer if steps here are slow: 4 x the slowest), then the ranks' exit; far from 5 minutes
    assert took < patience(120), f"named {took:.0f} s after the loader stopped"
    assert not [word for word in NOISE if word in run.output()], run.output()[-3000:]


@pytest.mark.slow
def test_the_workers_end_with_a_killed_launcher_before_the_workspace_is_free(tmp_path, cache_dir):
    """kill -9 of the torchrun launcher: its workers lived on for 1.6-33 s while the workspace already looked
    free. The spawn launcher's case is checked on the launch of tests/integration/test_fault_stops.py's killed spawn
    launcher."""
    from modules.util.workspace_lock import WorkspaceLock
    ws = tmp_path / "ws"
    run = Run(ws, cache_dir, "torchrun")
    run.wait_for_step(2)
    ranks = _ranks(run.proc.pid)
    assert len(ranks) == 2
    os.kill(run.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    run.proc.wait(timeout=patience(60))  # the launcher is gone (its own lock with it)
    lock = WorkspaceLock(ws).acquire()  # a new run's start: it may have to wait for the workers' own locks
    took = time.monotonic() - killed
    try:
        assert not _alive(ranks), "a worker of the killed launcher lived on while a new run took the workspace"
        assert took < patience(15), f"the workers ended {took:.0f} s after their launcher"
    finally:
        lock.release()
        run.finish()
