"""The queue's decisions, as pure functions over its jobs: no files, no processes, no clock of their own.

Which jobs start now (`plan_starts`): in queue order, each queued job takes the GPUs it needs from those no
running job holds - several at once on separate GPUs. A job that cannot start yet keeps the free GPUs it
waits for from the jobs behind it, so a 2-GPU job is never starved by a stream of 1-GPU jobs; a job whose
workspace another job is training in waits without holding any (two runs never write one workspace).

What an ended run makes of its job (`after_run`): done, failed (with the reason), cancelled, paused (it
continues from the backup its stop wrote) or, when its run vanished without an exit code - the machine
restarted, or its processes were killed - interrupted, to continue from its last backup.
"""
from __future__ import annotations

from dataclasses import dataclass

from .jobs import (CANCELLED, DONE, FAILED, INTERRUPTED, ON_GPUS, PAUSED, QUEUED, RUNNING, STARTING, GpuNeed,
                   Job)


@dataclass(frozen=True)
class Start:
    job_id: int
    devices: tuple[int, ...]


def held_devices(jobs: list[Job]) -> set[int]:
    return {d for job in jobs if job.on_gpus for d in job.devices}


def _pick(need: GpuNeed, free: list[int], capacity: int) -> tuple[int, ...] | None:
    """The GPUs `need` starts on among `free` (lowest numbers first), or None when they are not all free."""
    if need.devices:
        return need.devices if all(d in free for d in need.devices) else None
    size = need.size(capacity)
    return tuple(free[:size]) if len(free) >= size else None


def _kept_for(need: GpuNeed, free: list[int], capacity: int) -> set[int]:
    """The free GPUs a waiting job keeps from the jobs behind it."""
    if need.devices:
        return {d for d in need.devices if d in free}
    return set(free[:need.size(capacity)])


def plan_starts(jobs: list[Job], capacity: int, paused: bool = False) -> list[Start]:
    """The jobs to start now and their GPUs, in queue order (`jobs` is the queue). A paused queue starts none;
    a job whose need the machine can never meet is left to `impossible_jobs`."""
    if paused:
        return []
    free = [d for d in range(capacity) if d not in held_devices(jobs)]
    busy_workspaces = {job.workspace for job in jobs if job.on_gpus}
    starts = []
    for job in jobs:
        if job.state != QUEUED or job.request:
            continue
        need = job.gpu_need
        if need.problem(capacity):
            continue
        if job.workspace in busy_workspaces:
            continue
        picked = _pick(need, free, capacity)
        if picked is None:
            kept = _kept_for(need, free, capacity)
            free = [d for d in free if d not in kept]
            continue
        starts.append(Start(job.id, picked))
        free = [d for d in free if d not in picked]
        busy_workspaces.add(job.workspace)
    return starts


def impossible_jobs(jobs: list[Job], capacity: int, unit: str = "GPU") -> list[tuple[int, str]]:
    """Queued jobs this machine can never run (it has fewer GPUs than when they were added), with the reason."""
    found = []
    for job in jobs:
        if job.state == QUEUED:
            problem = job.gpu_need.problem(capacity, unit)
            if problem:
                found.append((job.id, f"cannot run here: {problem}"))
    return found


@dataclass(frozen=True)
class RunOutcome:
    """How a job's run ended, as its registry entry and log say."""
    state: str
    """The registry's: `running`, `starting`, `ended`, `lost` (gone without an exit code)."""
    exit_code: int | None = None
    output: str | None = None
    """The model its `done` event named."""
    completed: bool = False
    """Its `done` event said it trained to the end (a stopped run saves too, but is not complete)."""
    error: str | None = None
    """Its last `error` event, else the last log lines of a failed run."""
    train_run_id: str | None = None


def after_run(job: Job, outcome: RunOutcome, now: float) -> Job:
    """`job` (starting or running) as its run's `outcome` leaves it; unchanged while the run goes on."""
    if outcome.train_run_id:
        job.train_run_id = outcome.train_run_id
    if outcome.state in ("running", "starting"):
        if job.state == STARTING and outcome.state == "running":
            job.state = RUNNING
        return job
    job.ended, job.exit_code = now, outcome.exit_code
    if job.request == "cancel":
        job.state, job.message = CANCELLED, "cancelled while it ran"
    elif outcome.state == "lost":
        job.state = INTERRUPTED
        job.resume = job.train_run_id
        job.message = ("its processes ended without an exit code (the machine restarted, or they were killed)"
                       + ("; resume continues from its newest backup" if job.resume else "; resume starts it again"))
    elif job.request == "pause" and outcome.exit_code == 0:
        job.state, job.resume = PAUSED, job.train_run_id
        job.message = "paused: stopped with a backup; resume continues from it"
    elif outcome.exit_code == 0 and outcome.error is None:
        job.state, job.output = DONE, outcome.output
        job.message = "" if outcome.completed else "stopped before its last step (not by the queue)"
    else:
        job.state = FAILED
        reason = outcome.error or (f"exit code {outcome.exit_code}" if outcome.exit_code else "it ended without "
                                   "saving a model")
        job.message = reason
    job.request, job.requested_at = None, None
    if job.history:
        job.history[-1].update(ended=now, state=job.state)
    return job


def move(jobs: list[Job], job_id: int, where: str) -> list[Job]:
    """The queue with job `job_id` moved `up`, `down`, to the `top`, the `bottom`, or to position N (from 1).
    Only the order changes; running jobs keep running."""
    index = next((i for i, j in enumerate(jobs) if j.id == job_id), None)
    if index is None:
        raise KeyError(job_id)
    order = list(jobs)
    job = order.pop(index)
    if where == "up":
        to = max(index - 1, 0)
    elif where == "down":
        to = min(index + 1, len(order))
    elif where == "top":
        to = 0
    elif where == "bottom":
        to = len(order)
    else:
        try:
            to = int(where) - 1
        except ValueError:
            raise ValueError(f"move to {where!r}: say up, down, top, bottom or a position (1 is the top)") from None
        if not 0 <= to <= len(order):
            raise ValueError(f"move to {where}: the queue has positions 1 to {len(order) + 1}")
    order.insert(to, job)
    return order


def has_work(jobs: list[Job], paused: bool) -> bool:
    """Whether a runner has anything to do: a job on its GPUs to watch, or (queue not paused) one to start."""
    return any(j.on_gpus for j in jobs) or (not paused and any(j.state == QUEUED and not j.request for j in jobs))

