"""The GUI's side of the job queue (modules/queue), no Tk in here: what the Queue tab shows and what its buttons
and the Run tab's "Add to queue" do.

The GUI never runs jobs and never waits on them: it writes the queue file (under its lock, a moment) and starts
the queue's runner - its own detached process - when jobs wait; what it shows it reads from the queue file and
the jobs' logs. Closing the window stops nothing; reopening it shows the queue as it is, and runs that vanished
without an exit code (the machine restarted) as "interrupted - continue from backup".
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from modules.config import TrainConfig
from modules.queue import actions
from modules.queue.jobs import Job
from modules.queue.runner import ensure_runner, refresh
from modules.queue.store import QueueState, QueueStore
from modules.queue.view import JobRow, describe_queue, log_tail, rows


@dataclass
class QueueSnapshot:
    """The queue as one read found it."""
    header: str = ""
    rows: list[JobRow] = field(default_factory=list)
    paused: bool = False
    runner_alive: bool = False
    waiting: bool = False
    """Jobs are queued (the runner starts them)."""


THIS_COMPUTER = "This computer"


class QueueController:
    """This machine's queue. A remote machine's has the same methods: ui/remote_queue_controller.py."""

    machine_name = THIS_COMPUTER
    """Whose queue it is, as the Queue tab's header names it."""
    on_this_machine = True
    """Its jobs' models and logs are files here."""
    refresh_ms = 1000
    """How often the Queue tab reads it again."""

    def __init__(self, store: QueueStore | None = None, start_runner: Callable[[QueueStore], bool] = ensure_runner,
                 cwd: str | Path | None = None):
        self.store = store or QueueStore()
        self.start_runner = start_runner
        self.cwd = cwd
        """Where relative paths of a queued config are read from (the GUI's training runs there too)."""

    def capacity(self, visible_gpus: int) -> actions.Capacity:
        """The GPUs the GUI found, or the queue's CPU slots (set with `scripts/train_queue.py --slots`)."""
        return actions.capacity_of(self.store.read(), lambda: visible_gpus)

    def add(self, cfg: TrainConfig, name: str, visible_gpus: int) -> str:
        """Queue `cfg` with the GPUs its Multi-GPU settings ask for and start the runner; the line the window shows.
        `actions.Refused` when the machine is too small (its message says what to change)."""
        capacity = self.capacity(visible_gpus)
        need = actions.need_of_config(cfg)
        job = actions.add(self.store, cfg, need, capacity, name=name, source=name, cwd=self.cwd or os.getcwd(),
                          env=actions.home_variable())
        self.start_runner(self.store)
        return (f"Queued {job.label()} ({need.describe(capacity.unit)} of {capacity.describe()}): the Queue tab shows "
                "it; it starts when its GPUs are free, whether this window is open or not.")

    def snapshot(self) -> QueueSnapshot:
        """The queue now (off the Tk thread: it reads the logs of running jobs). With no runner going, runs that
        ended or vanished meanwhile are written first."""
        alive = self.store.runner_alive()
        if not alive and self.store.file.exists():
            refresh(self.store)
        state: QueueState = self.store.read()
        return QueueSnapshot(header=f"{self.machine_name} · {describe_queue(self.store, state, alive)}",
                             rows=rows(self.store, state),
                             paused=state.paused, runner_alive=alive,
                             waiting=any(job.state == "queued" for job in state.jobs))

    # --- the buttons: each changes the file, then makes sure a runner acts on it ---------------------------------
    def cancel(self, job_id: int) -> Job:
        return self._then_run(actions.cancel(self.store, job_id))

    def move(self, job_id: int, where: str) -> Job:
        return actions.move(self.store, job_id, where)

    def pause(self, job_id: int | None = None) -> Job | None:
        return self._then_run(actions.pause(self.store, job_id))

    def resume(self, job_id: int | None = None) -> Job | None:
        return self._then_run(actions.resume(self.store, job_id))

    def run(self) -> bool:
        return self.start_runner(self.store)

    def _then_run(self, job):
        if actions.waiting_or_running(self.store.read()):
            self.start_runner(self.store)
        return job

    def log_text(self, row: JobRow, limit: int = 200_000) -> str:
        """The end of a job's log (its current or last run)."""
        if not row.log:
            return f"#{row.id} {row.name} has not run yet."
        try:
            return log_tail(row.log, limit)
        except OSError as e:
            return f"The log {row.log} cannot be read ({e.strerror})."
