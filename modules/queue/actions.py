"""What a user does to the queue - the same words in the GUI and in `scripts/train_queue.py`: add, cancel, move,
pause, resume - each one change of the queue file under its lock. Work that takes time (ending a run) is the
runner's: a running job is marked, and the runner carries it out within a second or two.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from modules.config import RunPaths, TrainConfig, save_config
from modules.launch.spec import DEFAULT_CPU_PROCESSES

from .jobs import CANCELLED, ENDED, INTERRUPTED, ON_GPUS, PAUSED, QUEUED, GpuNeed, Job, NeedError
from .scheduler import move as reorder
from .store import QueueState, QueueStore


@dataclass(frozen=True)
class Capacity:
    """What this machine offers the queue: `count` GPUs, or (`cpu`) CPU slots standing in for them."""
    count: int
    cpu: bool

    @property
    def unit(self) -> str:
        return "CPU slot" if self.cpu else "GPU"

    def describe(self) -> str:
        return f"{self.count} {self.unit}" + ("s" if self.count != 1 else "")


def count_gpus() -> int:
    """The CUDA GPUs torch sees here (it honours CUDA_VISIBLE_DEVICES); 0 without a driver or a CUDA build."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def capacity_of(state: QueueState, gpus: Callable[[], int] = count_gpus) -> Capacity:
    """Slots set by hand win (CPU processes); else the GPUs counted; no GPU at all: one CPU slot."""
    if state.slots:
        return Capacity(state.slots, cpu=True)
    found = gpus()
    return Capacity(found, cpu=False) if found > 0 else Capacity(1, cpu=True)


def need_of_config(cfg: TrainConfig) -> GpuNeed:
    """The GPUs a config asks for in its Multi-GPU settings: the ticked GPUs, their number, all, or one GPU
    with Multi-GPU off. CPU processes (`general.device` cpu) count as slots."""
    m = cfg.multi_gpu
    if not m.enabled:
        return GpuNeed(count=1)
    if m.device_indexes.strip() and cfg.general.device != "cpu":
        return GpuNeed.parse(m.device_indexes if "," in m.device_indexes else m.device_indexes + ",")
    if m.num_gpus > 0:
        return GpuNeed(count=m.num_gpus)
    return GpuNeed(count=DEFAULT_CPU_PROCESSES) if cfg.general.device == "cpu" else GpuNeed(all=True)


def home_variable() -> dict[str, str]:
    """The job's Tandem home as its queuer's (built-in models, caches): TANDEM_HOME when set here, else none."""
    home = os.environ.get("TANDEM_HOME")
    return {"TANDEM_HOME": home} if home else {}


class Refused(ValueError):
    """The queue refuses the job; the message says why and what to change."""


def add(store: QueueStore, cfg: TrainConfig, need: GpuNeed, capacity: Capacity, name: str = "", source: str = "",
        cwd: str | os.PathLike | None = None, env: dict | None = None) -> Job:
    """Queue `cfg` (a snapshot: later edits of its file do not change the job) at the end of the queue."""
    problem = need.problem(capacity.count, capacity.unit)
    label = name or cfg.save.output_name or "job"
    if problem:
        raise Refused(f"{label!r} was not queued: {problem}. Ask for at most {capacity.describe()} "
                      f"(--gpus {capacity.count} or all), or queue it on a machine with more.")
    folder = Path(cwd or os.getcwd()).resolve()
    workspace = os.path.normpath(folder / RunPaths(cfg).workspace)
    with store.change() as state:
        job = Job(id=state.next_id, name=label, need=need.text(), config="", cwd=str(folder), workspace=workspace,
                  source=source, env=dict(env or {}), added=time.time())
        config = store.job_folder(job.id) / "config.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        save_config(cfg, config)
        job.config = str(config)
        state.next_id += 1
        state.jobs.append(job)
    return job


def cancel(store: QueueStore, key: str | int) -> Job:
    """A waiting job leaves the queue's work at once; a running one is ended by the runner (its run stops)."""
    with store.change() as state:
        job = state.find(key)
        if job.state in ENDED:
            raise Refused(f"{job.label()} has already ended ({job.state})")
        if job.on_gpus:
            job.request, job.requested_at = "cancel", None
        else:
            job.state, job.message, job.ended = CANCELLED, "cancelled before it ran" if not job.runs else \
                f"cancelled while {job.state}", time.time()
    return job


def move(store: QueueStore, key: str | int, where: str) -> Job:
    with store.change() as state:
        job = state.find(key)
        state.jobs = reorder(state.jobs, job.id, where)
    return job


def pause(store: QueueStore, key: str | int | None = None) -> Job | None:
    """Pause one job (a running one stops with a backup and later continues from it; a queued one waits), or,
    without a job, the whole queue: nothing new starts, running jobs go on."""
    with store.change() as state:
        if key is None:
            state.paused = True
            return None
        job = state.find(key)
        if job.on_gpus:
            job.request, job.requested_at = "pause", None
        elif job.state == QUEUED:
            job.state, job.message = PAUSED, "paused before it ran"
        else:
            raise Refused(f"{job.label()} is {job.state}: only a queued or running job can be paused")
    return job


def resume(store: QueueStore, key: str | int | None = None) -> Job | None:
    """Put a paused or interrupted job back in the queue at its place - it continues from its newest backup
    when it has one - or, without a job, let the whole queue start jobs again."""
    with store.change() as state:
        if key is None:
            state.paused = False
            return None
        job = state.find(key)
        if job.state not in (PAUSED, INTERRUPTED):
            raise Refused(f"{job.label()} is {job.state}: only a paused or interrupted job can be resumed")
        job.state, job.message = QUEUED, (f"continues from the newest backup of run {job.resume}" if job.resume
                                          else "")
    return job


def set_slots(store: QueueStore, slots: int | None) -> None:
    if slots is not None and slots < 1:
        raise Refused(f"--slots {slots}: give at least 1")
    with store.change() as state:
        state.slots = slots


def waiting_or_running(state: QueueState) -> bool:
    return any(j.state == QUEUED or j.state in ON_GPUS for j in state.jobs)
