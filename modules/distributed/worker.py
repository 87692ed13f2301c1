"""The body of every worker process: read the job, find this round's place, build the trainer and run it.

Workers of Tandem's launchers (spawn, torchrun) and of a user's own torchrun all end in `run_worker`,
which reads the standard torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, ...), so
`torchrun --nproc_per_node=N scripts/train.py --config-path X.json` works exactly like Tandem's launcher.
No config is loaded, validated or resolved here, and the data is not scanned again: the launcher's job
(`job.py`) carries all of it. A round that torchrun's agent restarted continues from the newest backup
this launch wrote (`restart_point`) and says why it restarted (`announce_restart`); a round on fewer
processes keeps the launch's global batch and learning rate (`keep_global_batch`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from modules.config import RunPaths, TrainConfig
from modules.distributed import failures
from modules.distributed.job import WorkerJob
from modules.distributed.plan import LaunchError
from modules.launch.layout import ParallelLayout
from modules.launch.spec import EXTERNAL, resolve_launch
from modules.util import launch_clock
from modules.util.logs import setup_logging
from modules.util.workspace_lock import WorkerLock, WorkspaceLock

log = logging.getLogger("tandem")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def external_worker_job(cfg: TrainConfig, resume: str | None) -> WorkerJob:
    """The job of a worker that someone else's torchrun started: the launch is the world it made."""
    spec = resolve_launch(cfg, torch.cuda.device_count(), torchrun_world=int(os.environ["WORLD_SIZE"]))
    if not cfg.multi_gpu.enabled:
        log.info("Note: multi_gpu.enabled is off, but torchrun started %d workers: they train together "
                 "(the setting decides only what Tandem's own starts run).", spec.world_size)
    return WorkerJob(cfg, spec, resume)


def restart_point(job: WorkerJob) -> tuple[str | None, object | None]:
    """(what to resume, the backup of this launch it is) for a round of workers: the newest complete backup
    that this launch wrote of its run - a restarted round continues there - else what the user asked for."""
    from modules.trainer import backup as backups

    if job.run_id is None:
        return job.resume, None
    newest = backups.latest_backup(RunPaths(job.cfg).backups, job.run_id)
    if newest is not None and newest.written >= job.launched_at:
        return str(newest.path), newest
    return job.resume, None


def reads_commands(job: WorkerJob, rank: int) -> bool:
    """Whether this worker reads the workspace's commands file: rank 0, and with several machines the
    first process of each, so that a stop written by any machine's launcher (its Ctrl-C) or by a person
    there reaches the step exchange, which gives every rank the union of all ranks' commands."""
    if job.spec.nnodes > 1:
        return int(os.environ.get("LOCAL_RANK", rank)) == 0
    return rank == 0


def run_worker(job: WorkerJob) -> None:
    """Body of every worker process (torchrun or spawn): build the trainer and run it."""
    from modules.distributed.distributed_trainer import DistributedTrainer
    from modules.trainer.callbacks import default_callbacks
    from modules.trainer.commands import CommandInbox
    from modules.trainer.rank_duties import rank_duties

    setup_logging()
    launched = job
    job = keep_global_batch(job, int(os.environ["WORLD_SIZE"]))
    cfg = job.cfg
    rank = int(os.environ["RANK"])
    duties = rank_duties(rank, default_callbacks())
    if job is not launched and duties.leads:
        text = (f"CONTINUING ON {job.spec.world_size} OF {launched.spec.world_size} PROCESSES (a machine was lost; "
                f"multi_gpu.min_gpus = {cfg.multi_gpu.min_gpus}): gradient accumulation {launched.spec.accumulation} "
                f"-> {job.spec.accumulation} keeps the global batch at {job.spec.global_batch}.")
        log.warning(text)
        duties.callbacks.on_event("status", text=text)
    inbox = CommandInbox(RunPaths(cfg).commands_file if reads_commands(job, rank) else None, start=job.commands_from)
    if job.workspace_held:  # the launcher holds the workspace: a new run waits until this rank has ended too
        WorkerLock(cfg.general.workspace_dir, rank).acquire()
    inbox.install_signal_handlers()
    resume, restarted_from = restart_point(job)
    if failures.current_attempt() > 0:
        launch_clock.forget()  # the command and the first round started long before this round
        if duties.leads:
            announce_restart(job, restarted_from, duties.callbacks, launched.spec.world_size)
    else:
        launch_clock.adopt(job.clock)
    trainer = DistributedTrainer(cfg, duties.callbacks, inbox, device_type=job.spec.device_type, resume=resume,
                                 run_id=job.run_id, launch=job.spec, scan=job.scan, rendezvous=job.rendezvous)
    try:
        if duties.leads and not job.workspace_held:  # a user's own torchrun: nobody took the workspace yet
            WorkspaceLock(cfg.general.workspace_dir).acquire()
        trainer.run()
    except BaseException as e:
        # Named here because torchrun/spawn only report an exit code; the user needs the rank and cause. The
        # trainer's watchdog noted it already, before the clean-up (which may have waited for other ranks).
        folder = failures.failures_folder(RunPaths(cfg).workspace)
        if not failures.recorded(folder, rank):
            failures.record_error(folder, rank, e, step=trainer.heartbeat.step or None, phase=trainer.heartbeat.phase)
        kind, text = type(e).__name__, " ".join(str(e).split())
        if not failures.is_secondary(kind, text):  # a lost peer's complaints stay in the details file
            log.error("rank %d failed: %s: %s", rank, kind, text[:500])
        if sends_error_event(job, kind, text):
            duties.callbacks.on_event("error", text=f"{kind}: {e}", rank=rank)
        raise


def sends_error_event(job: WorkerJob, kind: str, text: str) -> bool:
    """Whether a worker's own error becomes the run's `error` event (what the GUI shows as the failure).

    Under Tandem's launchers never: the launcher sends one, its headline, naming the rank that failed first as
    the notes and the watchdogs decide it. A worker's own event came first and named whatever rank 0 saw - after
    rank 1 was killed under torchrun, its "Connection closed by peer" (4 of 7 kills). Under a user's own torchrun
    nobody else speaks: the error, unless it is only about another rank."""
    return job.spec.launcher == EXTERNAL and not failures.is_secondary(kind, text)


def keep_global_batch(job: WorkerJob, world_size: int) -> WorkerJob:
    """The job for a round with fewer processes than launched (a machine lost, `multi_gpu.min_gpus`): the
    gradient accumulation raised so that the global batch - and the result - stay those of the launch (its
    learning rate too: `LaunchSpec` carries it as the launch computed it)."""
    spec = job.spec
    if world_size >= spec.world_size:
        return job
    launched = spec.accumulation * spec.layout.data
    try:
        layout = ParallelLayout.of(world_size, spec.layout.context)
    except ValueError as reason:
        raise LaunchError(f"continuing on {world_size} of {spec.world_size} processes: {reason} Set "
                          "multi_gpu.min_gpus to a GPU count that it divides.") from None
    if launched % layout.data:
        raise LaunchError(f"continuing on {world_size} of {spec.world_size} processes cannot keep the global batch "
                          f"of {spec.global_batch} (training.batch_size {spec.per_gpu_batch} x accumulation "
                          f"{spec.accumulation} x {spec.layout.data} data slices): {launched} micro-batches per step "
                          f"do not divide by {layout.data}. Set multi_gpu.min_gpus to a GPU count that divides it.")
    accumulation = launched // layout.data
    training = dataclasses.replace(job.cfg.training, gradient_accumulation_steps=accumulation)
    return dataclasses.replace(job, cfg=dataclasses.replace(job.cfg, training=training),
                               spec=dataclasses.replace(spec, accumulation=accumulation, world_size=world_size,
                                                        layout=layout))


def announce_restart(job: WorkerJob, backup, callbacks, world_before: int) -> None:
    """The restarted round's first words: "restart 1 of 3: rank 1 died (SIGKILL) at step 431; resuming from
    the backup at step 400" - in the log and as the GUI's `restart` event."""
    attempt = failures.current_attempt()
    limit = int(os.environ.get(failures.MAX_RESTARTS_VARIABLE, job.spec.max_restarts) or job.spec.max_restarts)
    exits = [e for e in failures.read_exits(Path(job.exits_file)) if e.attempt == attempt - 1] if job.exits_file else []
    errors = failures.read_errors(failures.failures_folder(RunPaths(job.cfg).workspace), attempt - 1)
    cause = failures.round_cause(exits, errors, world_before, job.cfg.multi_gpu.timeout_minutes)
    steps = [e.step for e in errors.values() if e.step is not None]
    failed_step = max(steps) if steps else None
    if failed_step is None:  # no rank could note its error (killed meanwhile): where the watchdogs last saw them
        failed_step = last_round_step(job)
    resumed = backup.step if backup is not None else None
    text = failures.restart_line(attempt, limit, cause, failed_step, resumed)
    log.warning(text)
    callbacks.on_event("restart", text=text, restart=attempt, max_restarts=limit, step=failed_step,
                       resumed_step=resumed)


def last_round_step(job: WorkerJob) -> int | None:
    """The furthest step the round before this one reached, as its ranks' watchdogs published it."""
    from modules.distributed import watchdog
    try:
        store = watchdog.connect(job.rendezvous, timeout_s=10.0)
    except Exception:  # noqa: BLE001 - not known
        return None
    return watchdog.previous_round_position(store, watchdog.round_key())[0] if store is not None else None
