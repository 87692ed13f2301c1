"""Starting a multi-process training: plan it, check it, start the workers, and say how it ended.

`launch` is what `scripts/train_multi_gpu.py` (and the GUI's multi-GPU Start, through it) runs: the
launch is planned once (`plan.py`: `resolve_launch`, the rendezvous port, the data scanned and checked),
every check that can fail is made before any worker starts (`modules/preflight.py` and those that need
the world size), then the launcher takes the workspace, serves the rendezvous store on the configured
address only (`rendezvous.py`), writes the workers' job (`job.py`) and starts them (`processes.py`:
spawn or torchrun), turning SIGINT/SIGTERM into a clean stop (`supervision.py`). The workers run
`worker.run_worker`. When the job fails, its last line names the rank that failed first, how and where
(`failures.py`), and the file with the details. One process (`scripts/train.py`): `modules/single_run.py`.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time

from modules.config import RunPaths, TrainConfig
from modules.distributed import failures, nodes, rendezvous
from modules.distributed.job import WorkerJob, job_path, write_job
from modules.distributed.plan import (LaunchError, LaunchPlan, check_data_fits, plan_launch, run_id_for,
                                      with_restart_backups)
from modules.distributed.processes import (ABORTED, exits_file_of, launch_spawn, launch_torchrun, rendezvous_timed_out,
                                          start_forkserver_now)
from modules.distributed.strategy import NoPlanFits, check_cards
from modules.distributed.supervision import StopSignals
from modules.preflight import PreflightError, preflight
from modules.util import launch_clock
from modules.util.batch_slice import parse_split
from modules.util.workspace_lock import WorkspaceBusy, WorkspaceLock

log = logging.getLogger("tandem")

SKIP_MEMORY_CHECK = "TANDEM_SKIP_MEMORY_CHECK"
"""Set to 1 to start a run the memory plan says fits no card (the estimate can be wrong for a model)."""


def launch(cfg: TrainConfig, check_data: bool = True, resume: str | None = None) -> int:
    """Start a multi-process run as configured (this machine's part of it, with several); returns the exit code.

    The config is resolved and the data scanned once, here; the workers read both from one file (`write_job`).
    `check_data=False` leaves the scan to the workers (tests that train on data they make themselves)."""
    from modules.trainer.callbacks import default_callbacks

    plan = plan_launch(cfg)
    # The workers' imports start now if they have not yet (`forkserver.start_before_imports`), beside the
    # checks below; a job the checks refuse ends the server with the launcher (`exit_now`).
    started_early = launch_clock.marks().get(launch_clock.FORKSERVER_STARTED) is not None
    if start_forkserver_now(plan) and started_early:
        log.info("The workers' forkserver started before PyTorch was imported was for other values than this "
                 "launch's (%s): started again.", plan.describe())
    cfg = with_restart_backups(cfg, plan.spec)
    try:
        parse_split(cfg.multi_gpu.batch_split, plan.spec.processes_here, cfg.training.batch_size)
    except ValueError as reason:
        raise LaunchError(f"multi_gpu.batch_split: {reason}.") from None
    try:
        preflight(cfg, plan.spec.layout.context)
    except PreflightError as e:
        raise LaunchError(str(e), e.in_window) from None
    try:
        check_cards(cfg, plan.spec)  # a config that fits no memory plan goes no further
    except NoPlanFits as e:
        if os.environ.get(SKIP_MEMORY_CHECK) != "1":
            raise LaunchError(f"multi_gpu: {e} (If the estimate is wrong for this model, {SKIP_MEMORY_CHECK}=1 "
                              "starts it anyway.)") from None
        log.warning("multi_gpu: %s Starting anyway (%s=1).", e, SKIP_MEMORY_CHECK)
    except ValueError as e:  # a limit per GPU for another number of GPUs
        raise LaunchError(str(e)) from None
    dataset = check_data_fits(cfg, plan.spec) if check_data or plan.spec.nnodes > 1 else None
    paths = RunPaths(cfg)
    errors_folder = failures.failures_folder(paths.workspace)
    node_rank = plan.spec.node_rank
    with _workspace_lock(cfg, node_rank):
        if node_rank == 0:
            failures.clear(errors_folder)
        commands = paths.commands_file
        # Commands written from here on are this run's, also those written before rank 0 reads the file.
        commands_from = commands.stat().st_size if commands.exists() else 0
        try:
            with StopSignals(commands) as signals:
                log.info("Tandem multi-GPU: %s", plan.describe())
                with node_rendezvous(plan) as (rendezvous_at, store):
                    if plan.spec.nnodes > 1:
                        nodes.agree(store, nodes.node_job(cfg, dataset, plan.spec.processes_here), plan.spec.nnodes,
                                    datetime.timedelta(minutes=plan.timeout_minutes), rendezvous_at)
                        log.info("All %d machines joined with the same config and dataset.", plan.spec.nnodes)
                    launched_at = time.time()
                    job_file = job_path(cfg, node_rank)
                    job = WorkerJob(cfg, plan.spec, resume, _run_id(cfg, resume, store, plan), launched_at,
                                    scan=dataset.scan() if dataset is not None else None, rendezvous=rendezvous_at,
                                    commands_from=commands_from, workspace_held=node_rank == 0,
                                    exits_file=str(exits_file_of(job_file, node_rank)) if plan.launcher != "spawn"
                                    else None, clock=launch_clock.marks(workers_started=launched_at))
                    write_job(job)
                    run = launch_spawn if plan.launcher == "spawn" else launch_torchrun
                    code, exits = run(job_file, plan, rendezvous_at, signals)
                    positions = _last_positions(rendezvous_at, plan) if code not in (0, ABORTED) else {}
        except rendezvous.RendezvousError as e:
            raise LaunchError(str(e)) from None
        except nodes.NodeMismatch as e:
            raise LaunchError(str(e)) from None
    if code == ABORTED:
        log.error("Training aborted by a second stop signal: %s", aborted_backup_line(job))
    elif code != 0:
        # The last line of the log, and the GUI's headline: the rank that failed first, not the last to complain.
        if plan.launcher != "spawn" and rendezvous_timed_out(exits_file_of(job_file, node_rank)):
            text = (f"the machines did not all come to the rendezvous at {rendezvous_at} within "
                    f"multi_gpu.timeout_minutes = {plan.timeout_minutes:g} (a machine lost, or its launcher not "
                    "started); start scripts/train_multi_gpu.py --resume on every machine to continue.")
            first = failures.Failure(None, text)
        elif plan.launcher != "spawn" and code < 0 and not exits:
            first = failures.Failure(None, agent_died_line(code))
        else:
            exits = failures.last_round(exits)
            attempt = max((e.attempt for e in exits), default=None)
            first = failures.first_failure(exits, failures.read_errors(errors_folder, attempt), positions)
            first = failures.with_details(first, errors_folder)
        log.error("Training failed: %s", first.text)
        default_callbacks().on_event("error", text=first.text, failed_rank=first.rank)
    return code if code >= 0 else 1  # an agent ended by a signal: a failure like any other, not 256 - signal


def _last_positions(rendezvous_at: str, plan: LaunchPlan) -> dict[int, tuple[int, str]]:
    """Where each rank of the last round was, as its watchdog last published it in the store."""
    from modules.distributed import watchdog
    try:
        return watchdog.last_round_positions(rendezvous.client(rendezvous_at, datetime.timedelta(seconds=10)))
    except Exception:  # noqa: BLE001 - the headline then says less
        return {}


def agent_died_line(code: int) -> str:
    """torchrun's agent ended by a signal before it could say how its workers ended."""
    how = failures.WorkerExit(0, code, 0.0).how()
    hint = " - killed from outside, or by the system for lack of memory" if code == -9 else ""
    return (f"torchrun's agent (the process that starts and watches the workers on this machine) died ({how}{hint}); "
            "its workers ended with it.")


def aborted_backup_line(job: WorkerJob) -> str:
    """What an abort left to continue: the newest backup this launch wrote of its run, if any (a stop's own
    backup may have been written before the second signal ended the workers)."""
    from modules.trainer import backup as backups

    newest = backups.latest_backup(RunPaths(job.cfg).backups, job.run_id) if job.run_id else None
    if newest is not None and newest.written >= job.launched_at:
        return (f"the workers were ended; the newest backup of this run is step {newest.step} ({newest.path}): "
                "continue it with --resume.")
    return "the workers were ended before they wrote a backup of this run."


@contextlib.contextmanager
def node_rendezvous(plan: LaunchPlan):
    """(`host:port`, a client of the store there) for this launch: node 0 serves it on master_addr (one
    machine: loopback unless the user names another address); other machines connect to node 0's."""
    timeout = datetime.timedelta(minutes=plan.timeout_minutes)
    if plan.spec.node_rank == 0:
        with rendezvous.serve(plan.master_addr, plan.master_port, timeout) as rendezvous_at:
            yield rendezvous_at, rendezvous.client(rendezvous_at, timeout) if plan.spec.nnodes > 1 else None
        return
    rendezvous_at = rendezvous.endpoint(plan.master_addr, plan.master_port)
    log.info("Node %d: connecting to node 0's rendezvous at %s (waiting up to %g minutes)", plan.spec.node_rank,
             rendezvous_at, plan.timeout_minutes)
    try:
        store = rendezvous.client(rendezvous_at, timeout)
    except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError alike
        raise LaunchError(f"node 0's rendezvous at {rendezvous_at} did not answer within multi_gpu.timeout_minutes = "
                          f"{plan.timeout_minutes:g} ({type(e).__name__}): start node 0 first (or at the same "
                          "time), and check multi_gpu.master_addr, the port and the firewall.") from None
    yield rendezvous_at, store


RUN_ID_KEY = "tandem-nodes/run-id"


def _run_id(cfg: TrainConfig, resume: str | None, store, plan: LaunchPlan) -> str:
    """The run id, decided by node 0 (and shared with the other machines through the store)."""
    if plan.spec.node_rank == 0:
        try:
            run_id = run_id_for(cfg, resume)
        except FileNotFoundError as e:  # --resume names no backup (the scripts check it before; a caller may not)
            raise LaunchError(str(e)) from None
        if store is not None:
            store.set(RUN_ID_KEY, run_id)
        return run_id
    store.wait([RUN_ID_KEY], datetime.timedelta(minutes=plan.timeout_minutes))
    return store.get(RUN_ID_KEY).decode()


def _workspace_lock(cfg: TrainConfig, node_rank: int = 0):
    """The workspace, taken for this launch; on machines other than node 0 nothing (node 0 holds it, and a
    shared workspace folder would otherwise refuse the second machine)."""
    if node_rank > 0:
        return contextlib.nullcontext()
    try:
        return WorkspaceLock(cfg.general.workspace_dir).acquire()
    except WorkspaceBusy as e:
        raise LaunchError(str(e)) from None
