"""The queue's runner: one detached process per queue file (its lock, `runner.lock`, held for its life) that
starts jobs as their GPUs free up and exits when nothing is queued or running.

Each second it reads how every running job's run is doing (the run registry and the run's log), writes what
ended (`scheduler.after_run`), carries out cancel and pause requests (a stop signal, or the `stop` command
that writes a backup first), and starts what `scheduler.plan_starts` says - each job as a supervised detached
run (`modules/remote/remote_side.py`), so a job outlives the runner. The queue lock is held only to read and
write the file, never while a job starts or stops.

Started by `scripts/train_queue.py add|resume|run` and by the GUI (`ensure_runner`); a second one finds the lock
taken and leaves at once. After the machine restarted, the runs it had started have no supervisor and no exit
code: `refresh` (the runner's first step, and `list`'s) shows them interrupted.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from modules.remote.remote_side import RUN_FILE, Runs, command, start
from modules.remote.runs import new_run_id

from .actions import Capacity, capacity_of, count_gpus
from .jobs import FAILED, QUEUED, RUNNING, STARTING, Job
from .launch import REPO, run_spec
from .log_summary import summarize
from .scheduler import RunOutcome, after_run, has_work, impossible_jobs, plan_starts
from .store import RUNNER_LOG, QueueStore

POLL_S = 1.0
CANCEL_GRACE_S = 60.0
"""How long a cancelled run may take to stop after SIGTERM (it stops at its next step) before SIGKILL."""
QUEUE_SCRIPT = REPO / "scripts" / "train_queue.py"


def run_outcome(runs_root: Path, job: Job) -> RunOutcome | None:
    """How the job's current run is doing; None when its run was never created (its start was cut short)."""
    run_id = job.run_id
    registry = Runs(runs_root)
    if run_id is None or not (registry.dir(run_id) / RUN_FILE).is_file():
        return None
    status = registry.status(run_id)
    summary = summarize(registry.dir(run_id) / "output.log")
    failed = status["state"] == "ended" and (status.get("exit_code") != 0 or summary.error is not None)
    return RunOutcome(state=status["state"], exit_code=status.get("exit_code"), output=summary.output,
                      completed=summary.completed, error=summary.failure() if failed else None,
                      train_run_id=summary.train_run_id)


def _apply_outcomes(store: QueueStore, state, now: float) -> None:
    runs_root = Path(state.runs_root).expanduser() if state.runs_root else store.folder
    for job in state.jobs:
        if not job.on_gpus:
            continue
        outcome = run_outcome(runs_root, job)
        if outcome is None:
            if job.state == STARTING and time.time() - (job.started or 0) > 60:
                job.runs.pop()  # its start never happened: back in line
                job.state, job.devices, job.started = QUEUED, [], None
                if job.history:
                    job.history.pop()
            continue
        after_run(job, outcome, now)


def refresh(store: QueueStore) -> None:
    """Write what ended since the file was last written (jobs whose run ended or vanished); what `list` and the
    GUI show after the runner is gone (the machine restarted)."""
    with store.change() as state:
        _apply_outcomes(store, state, time.time())


def _signal_group(pid: int | None, signum: int) -> None:
    if not pid:
        return
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class Runner:
    def __init__(self, store: QueueStore, gpus: Callable[[], int] = count_gpus, poll_s: float = POLL_S,
                 say: Callable[[str], None] = print):
        self.store, self.gpus, self.poll_s, self.say = store, gpus, poll_s, say
        self._lock: int | None = None

    def run(self) -> int:
        """Serve the queue until it has nothing left to run; 0 also when another runner serves it."""
        self._lock = self.store.take_runner_lock()
        if self._lock is None:
            self.say(f"a runner already serves the queue in {self.store.folder}")
            return 0
        try:
            capacity = capacity_of(self.store.read(), self.gpus)
            with self.store.change() as state:
                state.runner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                "capacity": capacity.count, "unit": capacity.unit, "source": REPO.name}
            self.say(f"serving the queue in {self.store.folder} on {capacity.describe()}")
            while self.tick(capacity):
                time.sleep(self.poll_s)
            self.say("the queue has nothing left to run")
            return 0
        finally:
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def tick(self, capacity: Capacity) -> bool:
        """One round: outcomes written, requests carried out, jobs started. False when the runner may leave (its
        lock is then given up while the queue's is held, so that a job added meanwhile starts a new runner)."""
        signals: list[tuple[Job, str]] = []
        starts: list[Job] = []
        with self.store.change() as state:
            now = time.time()
            runs_root = Path(state.runs_root).expanduser() if state.runs_root else self.store.folder
            _apply_outcomes(self.store, state, now)
            for job in state.jobs:
                if job.state == RUNNING and job.request:  # a starting run has no process to signal yet
                    if job.requested_at is None:
                        signals.append((job, job.request))
                        job.requested_at = now
                    elif job.request == "cancel" and now - job.requested_at > CANCEL_GRACE_S:
                        signals.append((job, "kill"))
                        job.requested_at = now  # once more a grace later, if even that did not end it
            for job_id, reason in impossible_jobs(state.jobs, capacity.count, capacity.unit):
                job = state.find(job_id)
                job.state, job.message, job.ended = FAILED, reason, now
            for plan in plan_starts(state.jobs, capacity.count, state.paused):
                job = state.find(plan.job_id)
                run_id = new_run_id(f"q{job.id}-{job.name}")
                job.state, job.devices, job.started, job.ended = STARTING, list(plan.devices), now, None
                job.exit_code, job.request, job.requested_at = None, None, None
                job.runs.append(run_id)
                job.history.append({"run": run_id, "devices": list(plan.devices), "started": now, "ended": None,
                                    "state": STARTING})
                starts.append(Job.from_dict(job.to_dict()))
            if not has_work(state.jobs, state.paused):
                self._release()
                return False
        for job, what in signals:
            self._carry_out(runs_root, job, what)
        for job in starts:
            self._start(runs_root, job, capacity)
        return True

    def _carry_out(self, runs_root: Path, job: Job, what: str) -> None:
        status = Runs(runs_root).status(job.run_id)
        self.say(f"{job.label()}: {what}")
        if what == "pause":
            try:
                command(runs_root, job.run_id, "stop")  # every rank stops at one step, with a backup
            except (OSError, ValueError) as e:
                self.say(f"{job.label()}: the stop command could not be written ({e})")
        elif what == "cancel":
            _signal_group(status.get("training_pid"), signal.SIGTERM)  # a clean stop at the next step
        else:
            _signal_group(status.get("training_pid"), signal.SIGKILL)

    def _start(self, runs_root: Path, job: Job, capacity: Capacity) -> None:
        devices = tuple(job.devices)
        try:
            spec, note = run_spec(job, job.run_id, devices, runs_root, capacity.cpu)
            start(runs_root, spec)
        except Exception as e:  # noqa: BLE001 - any failure to start fails this job only, with its reason
            self.say(f"{job.label()} could not start: {e}")
            with self.store.change() as state:
                entry = state.find(job.id)
                entry.state, entry.message, entry.ended = FAILED, f"could not start: {e}", time.time()
                if entry.history:
                    entry.history[-1].update(ended=entry.ended, state=FAILED)
            return
        self.say(f"{job.label()} started on {capacity.unit}{'s' if len(devices) > 1 else ''} "
                 f"{','.join(str(d) for d in devices)} as run {job.run_id}")
        with self.store.change() as state:
            entry = state.find(job.id)
            entry.message = note or ("continues from a backup" if "--resume" in spec["command"] else "")


def ensure_runner(store: QueueStore, python: str = sys.executable) -> bool:
    """Start the queue's runner, detached, unless one serves it already; True when one was started."""
    if store.runner_alive():
        return False
    store.folder.mkdir(parents=True, exist_ok=True)
    with open(store.folder / RUNNER_LOG, "ab") as log:
        subprocess.Popen([python, str(QUEUE_SCRIPT), "--folder", str(store.folder), "run", "--here"],
                         cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True, close_fds=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return True
