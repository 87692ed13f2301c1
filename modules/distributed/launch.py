"""Starting training: one process, or N workers through torchrun or torch.multiprocessing.spawn.

Both multi-process paths end in `run_worker`, which reads the standard torchrun variables
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a user's own
`torchrun --nproc_per_node=N scripts/train.py --config-path X.json` works exactly like ours.
Every check that can fail is done here, before any worker starts (`modules/preflight.py` and the
checks that need the world size). While the workers run, the launcher serves their rendezvous store
on the configured address only (`rendezvous.py`), turns SIGINT/SIGTERM into a clean stop
(`supervision.py`), and when the job fails its last line names the rank that failed first and how
(`failures.py`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from modules.config import RunPaths, TrainConfig, config_from_dict, config_to_dict
from modules.config.train_config import MultiGPUConfig
from modules.distributed import failures, nodes, rendezvous
from modules.distributed.agent import EXITS_VARIABLE
from modules.distributed.strategy import NoPlanFits, check_cards
from modules.config.launch_spec import LaunchSpec, resolve_launch
from modules.distributed.process_group import store_environment, threads_per_worker
from modules.distributed.supervision import HARD_KILL, StopSignals, signal_processes, watch
from modules.preflight import PreflightError, preflight
from modules.trainer import memory_limit
from modules.util.atomic import write_text_atomically
from modules.util.batch_slice import parse_split
from modules.util.exit import exit_now
from modules.util.launch_clock import WORKERS_STARTED, forget_launch_times
from modules.util.ports import find_free_port, port_is_free
from modules.util.workspace_lock import WorkspaceBusy, WorkspaceLock

log = logging.getLogger("tandem")
REPO_ROOT = Path(__file__).resolve().parents[2]
SCAN_REPORTED = "TANDEM_SCAN_REPORTED"
"""Set (to 1) for workers whose launcher has scanned the data and reported its warnings already."""
COMMANDS_FROM = "TANDEM_COMMANDS_FROM"
"""Byte offset of the commands file from which commands are this run's (taken before workers start)."""
SKIP_MEMORY_CHECK = "TANDEM_SKIP_MEMORY_CHECK"
"""Set to 1 to start a run the memory plan says fits no card (the estimate can be wrong for a model)."""
ABORTED = 130
"""Exit code when the user aborted a run (a second Ctrl-C), as a shell reports SIGINT."""
RESTART_BACKUP_MINUTES = 10.0
"""Backups every this many minutes when restarts are on and no backup cadence by steps or minutes is set:
a restart then repeats at most this much training."""


class LaunchError(PreflightError):
    """A problem found before any worker started; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """A launch as `resolve_launch` made it, and where its rendezvous listens."""
    spec: LaunchSpec
    master_addr: str
    master_port: int
    timeout_minutes: float = 10.0
    """How long ranks and machines wait for each other (`multi_gpu.timeout_minutes`)."""

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def device_type(self) -> str:
        return self.spec.device_type

    @property
    def backend(self) -> str:
        return self.spec.backend

    @property
    def launcher(self) -> str:
        return self.spec.launcher

    @property
    def visible_devices(self) -> str | None:
        """CUDA_VISIBLE_DEVICES for the workers, None = leave as is."""
        return self.spec.visible_devices

    def describe(self) -> str:
        spec = self.spec
        gpus = f"GPUs {self.visible_devices}" if self.visible_devices else f"{spec.processes_here} {self.device_type} process(es)"
        nodes = (f" on node {spec.node_rank} of {spec.nnodes} ({spec.processes_here} here)" if spec.nnodes > 1 else "")
        restarts = f", up to {spec.max_restarts} restart(s)" if spec.max_restarts else ""
        return (f"{self.world_size} worker(s){nodes} via {self.launcher}, backend {self.backend}, {gpus}, "
                f"rendezvous {self.master_addr}:{self.master_port}{restarts}")


def setup_logging() -> None:
    """Rank 0 logs INFO to stdout; other ranks only warnings and errors, tagged with their rank."""
    rank = int(os.environ.get("RANK", "0"))
    logger = logging.getLogger("tandem")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    # Every process scans the same image folders: their warnings (unreadable images, caption encodings)
    # come from the one that reports for the run - the launcher when there is one, else rank 0.
    reports = rank == 0 and os.environ.get(SCAN_REPORTED) != "1"
    logging.getLogger("modules.data.concepts").setLevel(logging.NOTSET if reports else logging.ERROR)
    quiet_libraries()


def quiet_libraries() -> None:
    """Keep the libraries' notices that say nothing to a Tandem user out of the log.

    transformers warns that image processors fall back to PIL without torchvision (Tandem needs no image
    processor), diffusers that a `.to(dtype)` cast could touch modules "kept in float32" (Tandem casts
    frozen parts on purpose, and prints the list even when it is empty); their weight-loading progress
    bars would fill a log file with carriage returns. torch.compile warns, once per call site, that
    diffusers' upsampling calls an `lru_cache` function it does not trace (a version check: nothing to
    trace; 20 lines per compile on H100 hosts). Only those messages are filtered: warnings that matter
    (missing weights, errors) pass. Nothing is imported here: the launcher process never needs these
    libraries, and importing them costs seconds.
    """
    for name, text in (("transformers.utils.import_utils", "requires torchvision"),
                       ("diffusers.models.modeling_utils", "should be kept in float32")):
        logging.getLogger(name).addFilter(lambda record, text=text: text not in record.getMessage())
    warnings.filterwarnings("ignore", message=re.escape("Dynamo detected a call to a `functools.lru_cache`-wrapped function"),
                            category=UserWarning)
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by transformers when it loads


# ---------------------------------------------------------------------------- planning
def plan_launch(cfg: TrainConfig) -> LaunchPlan:
    """The launch of `cfg` on this machine (`resolve_launch`, as the GUI previewed it) and its rendezvous port."""
    spec = resolve_launch(cfg, torch.cuda.device_count(), cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    if spec.problem:
        raise LaunchError(spec.problem)
    m = cfg.multi_gpu
    # A master_addr set in the config (or by --master-addr) wins over MASTER_ADDR from the environment.
    addr = m.master_addr if m.master_addr != MultiGPUConfig.master_addr else os.environ.get("MASTER_ADDR", m.master_addr)
    # An explicit --port / multi_gpu.master_port wins over MASTER_PORT from the environment.
    port = m.master_port or int(os.environ.get("MASTER_PORT", 0))
    if port == 0:
        port = find_free_port(addr)
    elif spec.node_rank == 0 and not port_is_free(port, addr):  # node 0 serves it; the others connect to it
        raise LaunchError(f"multi_gpu.master_port {port} is in use on {addr} (another training still running?). "
                          "Pick another with --port, or 0 to choose a free one.")
    return LaunchPlan(spec, addr, port, m.timeout_minutes)


def check_data_fits(cfg: TrainConfig, world_size: int):
    """Fail before starting workers when the data cannot fill one global batch per step; the scanned dataset."""
    from modules.data import BucketBatchSampler, EmptyDatasetError, MaskError, build_dataset
    from modules.trainer.run_numbers import derive_run_numbers

    try:
        dataset = build_dataset(cfg.data, RunPaths(cfg).cache, cfg.general.seed)
    except (EmptyDatasetError, MaskError, FileNotFoundError) as e:
        raise LaunchError(str(e)) from None
    try:
        sampler = BucketBatchSampler(dataset.buckets, cfg.training.batch_size, world_size=world_size, rank=0,
                                     seed=cfg.general.seed)
        derive_run_numbers(cfg, world_size, len(sampler))
    except ValueError as e:
        raise LaunchError(str(e)) from None
    return dataset


def with_restart_backups(cfg: TrainConfig, spec: LaunchSpec) -> TrainConfig:
    """`cfg` with timed backups when restarts are on and nothing else would back up within an epoch."""
    s = cfg.save
    if spec.max_restarts == 0 or s.backup_every_n_minutes > 0 or s.backup_every_n_steps > 0:
        return cfg
    log.info("multi_gpu.max_restarts is %d: backups every %g minutes, so a restart repeats at most that much "
             "(set save.backup_every_n_minutes or save.backup_every_n_steps to choose).", spec.max_restarts,
             RESTART_BACKUP_MINUTES)
    return dataclasses.replace(cfg, save=dataclasses.replace(s, backup_every_n_minutes=RESTART_BACKUP_MINUTES))


def run_id_for(cfg: TrainConfig, resume: str | None) -> str:
    """The run's id, decided before any worker starts so that restarted workers find its backups: the id of
    the backup `resume` names, else a new one."""
    from modules.trainer import backup as backups

    folder = RunPaths(cfg).backups
    if resume is not None:
        chosen = backups.find_backup(folder, resume)
        if chosen.run_id != backups.LEGACY_RUN:
            return chosen.run_id
    return backups.new_run_id(folder)


# ---------------------------------------------------------------------------- workers
@dataclasses.dataclass(frozen=True)
class WorkerJob:
    """Everything a worker needs besides the torchrun variables: the validated config, the launch
    resolved from it, and the backup to continue. Tandem's launchers hand it over as one JSON file."""
    cfg: TrainConfig
    spec: LaunchSpec
    resume: str | None = None
    run_id: str | None = None
    """The run's id when the launcher decided it (None: rank 0 decides, as in one process)."""
    launched_at: float = 0.0
    """When the launch began (seconds since the epoch): a backup of `run_id` written since then was written
    by this launch's workers, so a restarted round continues from it."""


JOB_FILE = "launch.json"
"""The job's file, in `<workspace>/.tandem/`; written for each launch, read by every worker."""


def job_file_name(node_rank: int) -> str:
    """Each machine's job differs (its node rank): with a shared workspace they must not share a file."""
    return JOB_FILE if node_rank == 0 else f"launch-node-{node_rank}.json"


def write_job(job: WorkerJob) -> Path:
    path = RunPaths(job.cfg).workspace / ".tandem" / job_file_name(job.spec.node_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"config": config_to_dict(job.cfg), "launch": job.spec.as_dict(), "resume": job.resume,
            "run_id": job.run_id, "launched_at": job.launched_at}
    write_text_atomically(path, json.dumps(data, indent=2))
    return path


def read_job(path: str | os.PathLike) -> WorkerJob:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return WorkerJob(config_from_dict(data["config"], source=str(path)), LaunchSpec.from_dict(data["launch"]),
                     data["resume"], data.get("run_id"), data.get("launched_at", 0.0))


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
    start = os.environ.get(COMMANDS_FROM)
    inbox = CommandInbox(RunPaths(cfg).commands_file if reads_commands(job, rank) else None,
                         start=int(start) if start is not None else None)
    inbox.install_signal_handlers()
    resume, restarted_from = restart_point(job)
    if failures.current_attempt() > 0:
        forget_launch_times()
        if duties.leads:
            announce_restart(job, restarted_from, duties.callbacks, launched.spec.world_size)
    trainer = DistributedTrainer(cfg, duties.callbacks, inbox, device_type=job.spec.device_type, resume=resume,
                                 run_id=job.run_id)
    try:
        if duties.leads:  # a user's own torchrun: no launcher took the workspace for this run (else a no-op)
            WorkspaceLock(cfg.general.workspace_dir).acquire()
        trainer.run()
    except BaseException as error:
        e = memory_limit.explained(error, trainer)  # out of memory: the figures, not CUDA's traceback
        # Named here because torchrun/spawn only report an exit code; the user needs the rank and cause.
        log.error("rank %d failed: %s: %s", rank, type(e).__name__, e)
        failures.record_error(failures.failures_folder(RunPaths(cfg).workspace), rank, e,
                              step=getattr(trainer, "global_step", None) if getattr(trainer, "first_step_done", False) else None)
        duties.callbacks.on_event("error", text=f"{type(e).__name__}: {e}", rank=rank)
        if e is not error:
            raise SystemExit(1) from None  # said in full above; the launcher names the rank that failed first
        raise


def keep_global_batch(job: WorkerJob, world_size: int) -> WorkerJob:
    """The job for a round with fewer processes than launched (a machine lost, `multi_gpu.min_gpus`): the
    gradient accumulation raised so that the global batch - and the result - stay those of the launch."""
    spec = job.spec
    if world_size >= spec.world_size:
        return job
    launched = spec.accumulation * spec.world_size
    if launched % world_size:
        raise LaunchError(f"continuing on {world_size} of {spec.world_size} processes cannot keep the global batch "
                          f"of {spec.global_batch} (training.batch_size {spec.per_gpu_batch} x accumulation "
                          f"{spec.accumulation} x {spec.world_size} processes): {launched} micro-batches per step do "
                          f"not divide by {world_size}. Set multi_gpu.min_gpus to a GPU count that divides it.")
    accumulation = launched // world_size
    training = dataclasses.replace(job.cfg.training, gradient_accumulation_steps=accumulation)
    return dataclasses.replace(job, cfg=dataclasses.replace(job.cfg, training=training),
                               spec=dataclasses.replace(spec, accumulation=accumulation, world_size=world_size))


def announce_restart(job: WorkerJob, backup, callbacks, world_before: int) -> None:
    """The restarted round's first words: "restart 1 of 3: rank 1 died (SIGKILL) at step 431; resuming from
    the backup at step 400" - in the log and as the GUI's `restart` event."""
    attempt = failures.current_attempt()
    limit = int(os.environ.get(failures.MAX_RESTARTS_VARIABLE, job.spec.max_restarts) or job.spec.max_restarts)
    exits_file = os.environ.get(EXITS_VARIABLE)
    exits = [e for e in _read_exits(Path(exits_file)) if e.attempt == attempt - 1] if exits_file else []
    errors = failures.read_errors(failures.failures_folder(RunPaths(job.cfg).workspace), attempt - 1)
    cause = failures.round_cause(exits, errors, world_before, job.cfg.multi_gpu.timeout_minutes)
    steps = [e.step for e in errors.values() if e.step is not None]
    failed_step = max(steps) if steps else None
    resumed = backup.step if backup is not None else None
    text = failures.restart_line(attempt, limit, cause, failed_step, resumed)
    log.warning(text)
    callbacks.on_event("restart", text=text, restart=attempt, max_restarts=limit, step=failed_step,
                       resumed_step=resumed)


def external_worker_job(cfg: TrainConfig, resume: str | None) -> WorkerJob:
    """The job of a worker that someone else's torchrun started: the launch is the world it made."""
    spec = resolve_launch(cfg, torch.cuda.device_count(), torchrun_world=int(os.environ["WORLD_SIZE"]))
    if not cfg.multi_gpu.enabled:
        log.info("Note: multi_gpu.enabled is off, but torchrun started %d workers: they train together "
                 "(the setting decides only what Tandem's own starts run).", spec.world_size)
    return WorkerJob(cfg, spec, resume)


def worker_variables(plan: LaunchPlan, rank: int, rendezvous_at: str) -> dict[str, str]:
    """The torchrun variables of one spawned worker, and where its launcher serves the rendezvous."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(plan.world_size),
                LOCAL_WORLD_SIZE=str(plan.world_size), MASTER_ADDR=plan.master_addr,
                MASTER_PORT=str(plan.master_port), **{rendezvous.RENDEZVOUS_VARIABLE: rendezvous_at})


def _spawn_entry(local_rank: int, job_file: str, plan: LaunchPlan, rendezvous_at: str) -> None:
    os.environ.update(worker_variables(plan, local_rank, rendezvous_at))
    run_worker(read_job(job_file))
    exit_now(0)  # finished and closed: skip the interpreter's slow clean-up (errors raised above keep spawn's report)


def _worker_env(plan: LaunchPlan) -> dict:
    env = dict(os.environ)
    if plan.visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = plan.visible_devices
    # Forced, not defaulted: torchrun's own store and each worker's fail on Windows with USE_LIBUV=1.
    env.update(store_environment())
    # Each worker gets a share of the cores instead of all of them fighting over every core (and
    # torchrun's own default of 1 thread, which starves CPU workers).
    env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(plan.spec.processes_here)))
    env[SCAN_REPORTED] = "1"  # check_data_fits scanned the data here and warned about what it skipped
    return env


_SPAWN_VARIABLES = ("CUDA_VISIBLE_DEVICES", "USE_LIBUV", "OMP_NUM_THREADS", SCAN_REPORTED)


@contextlib.contextmanager
def spawn_environment(plan: LaunchPlan | None):
    """The workers' variables (their GPUs, threads) set in this process while it spawns them, then restored.

    Spawned children inherit this process's environment; restoring it afterwards keeps the parent
    seeing every GPU, e.g. for a larger next run (`scripts/benchmark.py --gpus 1,2,4`)."""
    if plan is None:
        yield
        return
    env = _worker_env(plan)
    with environment({k: env[k] for k in _SPAWN_VARIABLES if k in env}):
        yield


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """`values` set in this process's environment (children started meanwhile inherit them), then restored."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, value in before.items():
            if value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = value


def launch_spawn(job_file: Path, plan: LaunchPlan, rendezvous_at: str,
                 signals: StopSignals) -> tuple[int, list[failures.WorkerExit]]:
    """(exit code, the failures seen first) of N spawned workers."""
    import torch.multiprocessing as mp

    # The children inherit SIGINT ignored until run_worker installs their stop handler: a Ctrl-C
    # during their start-up (a terminal sends it to every process) must not kill them half-built.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with spawn_environment(plan):
            context = mp.start_processes(_spawn_entry, args=(str(job_file), plan, rendezvous_at),
                                         nprocs=plan.world_size, join=False, start_method="spawn")
    finally:
        signal.signal(signal.SIGINT, previous)
    processes = context.processes
    signals.attach(lambda signum: signal_processes(processes, signum))
    try:
        exits = watch(processes)
    finally:
        for error_file in context.error_files:  # spawn's per-child traceback files
            with contextlib.suppress(OSError):
                os.unlink(error_file)
    if signals.aborted:
        return ABORTED, []
    return (1 if exits else 0), exits


def launch_torchrun(job_file: Path, plan: LaunchPlan, rendezvous_at: str,
                    signals: StopSignals) -> tuple[int, list[failures.WorkerExit]]:
    """(exit code, the failures torchrun's agent saw first) of torchrun's workers on this machine."""
    exits_file = exits_file_of(job_file, plan.spec.node_rank)
    exits_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "modules.distributed.agent", *agent_arguments(plan, rendezvous_at),
           str(REPO_ROOT / "scripts" / "train.py"), "--launch-file", str(job_file)]
    log.info("Running torchrun (torch.distributed.run): %s", " ".join(cmd))
    env = _worker_env(plan)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update({rendezvous.RENDEZVOUS_VARIABLE: rendezvous_at, EXITS_VARIABLE: str(exits_file),
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    # torchrun runs in its own process group: a Ctrl-C here becomes a clean "stop" (every rank stops at
    # the same step and backs up) instead of torchrun's signal handling, which reports a failure.
    proc = subprocess.Popen(cmd, env=env, **_own_process_group())
    signals.attach(lambda signum: _signal_group(proc, signum))
    code = proc.wait()
    if signals.aborted:
        return ABORTED, []
    return code, _read_exits(exits_file) if code != 0 else []


def exits_file_of(job_file: Path, node_rank: int) -> Path:
    return job_file.parent / ("worker-exits.json" if node_rank == 0 else f"worker-exits-node-{node_rank}.json")


def agent_arguments(plan: LaunchPlan, rendezvous_at: str) -> list[str]:
    """torchrun's options for this machine's agent.

    It joins the store this launcher (node 0's) serves - c10d rendezvous as a client, is_host=false - and
    starts no store of its own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE): nothing listens on other addresses.
    Every machine's agent waits `multi_gpu.timeout_minutes` for the others (join_timeout; torchrun's own
    default is 10 minutes). With `min_gpus`, a round that has its least machines waits for the missing ones
    10 s more (or half that timeout if shorter: the whole rendezvous must end within it) after the
    rendezvous forgot the lost one (3 missed 5 s heartbeats) - last_call_timeout, torchrun's is 30 s. The
    agents of the machines still alive rejoin at once, so 10 s only waits for a machine that comes back. The rendezvous numbers machines in the order of their `local_addr`, so naming
    each after its node rank puts global rank 0 on node 0, which writes the outputs."""
    spec = plan.spec
    timeout_s = max(1, round(60 * plan.timeout_minutes))
    nodes = f"{spec.min_nodes}:{spec.nnodes}" if spec.min_nodes and spec.min_nodes < spec.nnodes else str(spec.nnodes)
    arguments = [f"--nproc_per_node={spec.processes_here}", f"--nnodes={nodes}", "--rdzv_backend=c10d",
                 f"--rdzv_endpoint={rendezvous_at}", f"--rdzv_conf=is_host=false,join_timeout={timeout_s},last_call_timeout={max(1, min(10, timeout_s // 2))}",
                 f"--rdzv_id=tandem-{plan.master_port}", f"--max_restarts={spec.max_restarts}"]
    if spec.nnodes > 1:
        arguments.append(f"--local_addr=tandem-node-{spec.node_rank:04d}")
    return arguments


def _read_exits(exits_file: Path) -> list[failures.WorkerExit]:
    """Every failed round's exits as the agent noted them (not its notes about the rendezvous)."""
    try:
        return [failures.WorkerExit(**entry) for entry in json.loads(exits_file.read_text(encoding="utf-8"))
                if "rank" in entry]
    except (OSError, ValueError, TypeError):
        return []


def _rendezvous_timed_out(exits_file: Path) -> bool:
    try:
        return any(entry.get("rendezvous") == "timeout" for entry in json.loads(exits_file.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def _own_process_group() -> dict:
    """Popen arguments: a new process group that dies with this process (Linux) so no worker is orphaned."""
    if os.name != "posix":
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}

    def child_setup() -> None:
        os.setsid()
        if sys.platform.startswith("linux"):
            import ctypes
            pr_set_pdeathsig = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    return {"preexec_fn": child_setup}


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signal.CTRL_BREAK_EVENT if signum != HARD_KILL else signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass


def launch(cfg: TrainConfig, check_data: bool = True, resume: str | None = None) -> int:
    """Start a multi-process run as configured (this machine's part of it, with several); returns the exit code.

    The config is resolved once (`plan_launch`); the workers read the result from one file (`write_job`)."""
    from modules.trainer.callbacks import default_callbacks

    plan = plan_launch(cfg)
    cfg = with_restart_backups(cfg, plan.spec)
    try:
        parse_split(cfg.multi_gpu.batch_split, plan.spec.processes_here, cfg.training.batch_size)
    except ValueError as reason:
        raise LaunchError(f"multi_gpu.batch_split: {reason}.") from None
    try:
        preflight(cfg)
    except PreflightError as e:
        raise LaunchError(str(e)) from None
    try:
        check_cards(cfg, plan.spec)  # a config that fits no memory plan goes no further
    except NoPlanFits as e:
        if os.environ.get(SKIP_MEMORY_CHECK) != "1":
            raise LaunchError(f"multi_gpu: {e} (If the estimate is wrong for this model, {SKIP_MEMORY_CHECK}=1 "
                              "starts it anyway.)") from None
        log.warning("multi_gpu: %s Starting anyway (%s=1).", e, SKIP_MEMORY_CHECK)
    except ValueError as e:  # a limit per GPU for another number of GPUs
        raise LaunchError(str(e)) from None
    dataset = check_data_fits(cfg, plan.world_size) if check_data or plan.spec.nnodes > 1 else None
    paths = RunPaths(cfg)
    errors_folder = failures.failures_folder(paths.workspace)
    node_rank = plan.spec.node_rank
    with _workspace_lock(cfg, node_rank) as lock, environment(lock.child_environment()):
        if node_rank == 0:
            failures.clear(errors_folder)
        commands = paths.commands_file
        # Commands written from here on are this run's, also those written before rank 0 reads the file.
        start = str(commands.stat().st_size if commands.exists() else 0)
        try:
            with environment({COMMANDS_FROM: start}), StopSignals(commands) as signals:
                log.info("Tandem multi-GPU: %s", plan.describe())
                with node_rendezvous(plan) as (rendezvous_at, store):
                    if plan.spec.nnodes > 1:
                        nodes.agree(store, nodes.node_job(cfg, dataset, plan.spec.processes_here), plan.spec.nnodes,
                                    datetime.timedelta(minutes=plan.timeout_minutes), rendezvous_at)
                        log.info("All %d machines joined with the same config and dataset.", plan.spec.nnodes)
                    job = WorkerJob(cfg, plan.spec, resume, _run_id(cfg, resume, store, plan), time.time())
                    run = launch_spawn if plan.launcher == "spawn" else launch_torchrun
                    job_file = write_job(job)
                    with environment({WORKERS_STARTED: repr(job.launched_at)}):
                        code, exits = run(job_file, plan, rendezvous_at, signals)
        except rendezvous.RendezvousError as e:
            raise LaunchError(str(e)) from None
        except nodes.NodeMismatch as e:
            raise LaunchError(str(e)) from None
    if code == ABORTED:
        log.error("Training aborted by a second stop signal: the workers were ended without a backup.")
    elif code != 0:
        # The last line of the log, and the GUI's headline: the rank that failed first, not the last to complain.
        if plan.launcher != "spawn" and _rendezvous_timed_out(exits_file_of(job_file, node_rank)):
            text = (f"the machines did not all come to the rendezvous at {rendezvous_at} within "
                    f"multi_gpu.timeout_minutes = {plan.timeout_minutes:g} (a machine lost, or its launcher not "
                    "started); start scripts/train_multi_gpu.py --resume on every machine to continue.")
            first = failures.Failure(None, text)
        else:
            exits = failures.last_round(exits)
            attempt = max((e.attempt for e in exits), default=None)
            first = failures.first_failure(exits, failures.read_errors(errors_folder, attempt))
        log.error("Training failed: %s", first.text)
        default_callbacks().on_event("error", text=first.text, failed_rank=first.rank)
    return code


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
        return _NoLock()
    try:
        return WorkspaceLock(cfg.general.workspace_dir).acquire()
    except WorkspaceBusy as e:
        raise LaunchError(str(e)) from None


class _NoLock:
    def __enter__(self) -> "_NoLock":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def child_environment(self) -> dict[str, str]:
        return {}


def run_single(cfg: TrainConfig, resume: str | None = None) -> int:
    """One process, no process group."""
    from modules.trainer.callbacks import default_callbacks
    from modules.trainer.commands import CommandInbox
    from modules.trainer.generic_trainer import GenericTrainer

    setup_logging()
    preflight(cfg)  # raises PreflightError, whose message is the whole story
    inbox = CommandInbox(RunPaths(cfg).commands_file)
    inbox.install_signal_handlers()
    callbacks = default_callbacks()
    try:
        lock = WorkspaceLock(cfg.general.workspace_dir).acquire()
    except WorkspaceBusy as e:
        log.error("error: %s", e)
        callbacks.on_event("error", text=str(e), rank=0)
        return 2
    trainer = None
    try:
        with lock:
            trainer = GenericTrainer(cfg, callbacks, inbox, resume)
            trainer.run()
    except Exception as error:
        e = memory_limit.explained(error, trainer) if trainer is not None else error
        callbacks.on_event("error", text=f"{type(e).__name__}: {e}", rank=0)
        if e is not error:
            log.error("error: %s", e)
            return 1
        raise
    return 0


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
