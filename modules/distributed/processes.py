"""Starting and watching a launch's worker processes: through torch.multiprocessing's spawn, or torchrun.

Both start `worker.run_worker` with the job file the launcher wrote (`job.py`); what a worker needs besides
is in that job, not in the environment. The environment gets only what the processes need before any of
Tandem's code runs: the standard torchrun variables (spawn sets them itself), the GPUs each machine's
workers see, their share of the cores, the store's settings on Windows, and PyTorch's C++ log level.
Workers end with their parent (`supervision.end_with_parent`); torchrun's agent runs in a session of its
own and is killed with the launcher, so a Ctrl-C reaches it as Tandem's clean stop, not as torchrun's.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from modules.distributed import failures, forkserver
from modules.distributed.agent import EXITS_VARIABLE
from modules.distributed.plan import LaunchPlan
from modules.distributed.supervision import HARD_KILL, StopSignals, end_with_parent, signal_processes, watch
from modules.distributed.worker_environment import environment, worker_environment
from modules.distributed.worker_environment import start_variables as spec_start_variables
from modules.util.exit import exit_now

log = logging.getLogger("tandem")
REPO_ROOT = Path(__file__).resolve().parents[2]
ABORTED = 130
"""Exit code when the user aborted a run (a second Ctrl-C), as a shell reports SIGINT."""


def worker_variables(plan: LaunchPlan, rank: int) -> dict[str, str]:
    """The torchrun variables of one spawned worker."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(plan.world_size),
                LOCAL_WORLD_SIZE=str(plan.world_size), MASTER_ADDR=plan.master_addr, MASTER_PORT=str(plan.master_port))


def _spawn_entry(local_rank: int, job_file: str, plan: LaunchPlan, launcher_pid: int) -> None:
    from modules.distributed.job import read_job
    from modules.distributed.worker import run_worker

    end_with_parent(launcher_pid)
    os.environ.update(worker_variables(plan, local_rank))
    run_worker(read_job(job_file))
    exit_now(0)  # finished and closed: skip the interpreter's slow clean-up (errors raised above keep spawn's report)


def _worker_env(plan: LaunchPlan) -> dict:
    return worker_environment(plan.spec)


def start_workers(entry, args: tuple, nprocs: int, plan: LaunchPlan | None, join: bool):
    """torch.multiprocessing's `start_processes` of `nprocs` workers running `entry(rank, *args)` with the
    workers' variables of `plan` (their GPUs, threads; None: this process's own). Returns its process
    context. The forkserver stays for the next start of this process (a test session's launches) and ends
    with the process (`exit_now`) or `stop_forkserver()` (the benchmark ends it after each case).

    A forked worker takes from this start, not from the server it is forked from, what a spawned worker
    would: the environment, working folder, umask and output (`_StartState`). Only what libraries read while
    the server imported them cannot be handed over: a start under other such variables (another GPU set,
    thread count, torch or CUDA setting: `forkserver.READ_AT_IMPORT`) or another `sys.path` gets a new server."""
    import torch.multiprocessing as mp

    method = forkserver.start_method()
    variables = start_variables(plan)
    state = None
    if method == "forkserver":
        environ = {**os.environ, **variables}
        forkserver.keep_or_replace(forkserver.preload_for(entry.__module__), environ)
        state = _StartState(environ)
    with environment(variables):
        return mp.start_processes(_forked_entry, args=(entry, args, state), nprocs=nprocs, join=join,
                                  start_method=method)


def start_forkserver_now(plan: LaunchPlan, entry=None) -> bool:
    """Start the spawn launcher's forkserver for `plan`'s workers (running `entry`, by default the launcher's)
    now, while the launcher still checks the job (the memory plan, the data, the rendezvous): the server's
    imports then run beside those checks instead of after them, and the workers' start (`start_workers`)
    keeps it. Whether a server was started (none for torchrun, none where this system has no forkserver,
    none where one started with these values runs already: `forkserver.start_before_imports`'s)."""
    if plan.launcher != "spawn" or forkserver.start_method() != "forkserver":
        return False
    return forkserver.start_now(forkserver.preload_for(entry.__module__ if entry else forkserver.LAUNCHER_ENTRY_MODULE),
                                start_variables(plan))


class _StartState:
    """What a worker forked from the server takes from the start that asked for it: the launcher's environment
    then, working folder, umask, and its standard output and error (passed as descriptors: a test's captured
    output, a log file the launcher's output goes to)."""

    def __init__(self, environ: dict[str, str]):
        self.environ = environ
        self.cwd = os.getcwd()
        self.umask = os.umask(0)
        os.umask(self.umask)

    def __getstate__(self) -> dict:
        from multiprocessing import reduction

        # Pickled while multiprocessing starts the worker: DupFd hands the descriptor over with the request.
        outputs = [reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2)]
        return {**self.__dict__, "outputs": outputs}

    def apply(self) -> None:
        for target, handed in zip((1, 2), self.__dict__.pop("outputs", ())):
            if handed is not None:
                fd = handed.detach()
                os.dup2(fd, target)
                os.close(fd)
        os.chdir(self.cwd)
        os.umask(self.umask)
        os.environ.clear()
        os.environ.update(self.environ)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


stop_forkserver = forkserver.stop
start_method = forkserver.start_method


def _forked_entry(rank: int, entry, args: tuple, state: _StartState | None) -> None:
    _die_with_the_server()
    if state is not None:
        state.apply()
    _undo_the_forkserver_settings()
    entry(rank, *args)


def _die_with_the_server() -> None:
    """A worker's first act: end with the process it was started from - the forkserver, which dies with the
    launcher (`forkserver_setup`), or under spawn the launcher itself. The server's pid is checked too: had it
    died already, this worker would have no parent to die with and would train on alone."""
    setup = sys.modules.get("modules.distributed.forkserver_setup")
    end_with_parent(setup.server_pid if setup is not None else None)


def _undo_the_forkserver_settings() -> None:
    """What a worker forked from the server must not keep (`forkserver_setup.py`); nothing under spawn."""
    setup = sys.modules.get("modules.distributed.forkserver_setup")
    if setup is None:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if setup.users_nvml_check is None:
        os.environ.pop(setup.NVML_CHECK, None)
    else:
        os.environ[setup.NVML_CHECK] = setup.users_nvml_check
    _let_the_forkserver_end_with_the_launcher()


def _let_the_forkserver_end_with_the_launcher() -> None:
    """multiprocessing hands each forkserver child the write end of the pipe whose closing tells the server
    that its launcher is gone (so that a child could start processes through the same server). Held by the
    workers, it kept the server - the workers' parent, with which they die - alive after a killed launcher,
    and so the workers too. A worker that starts processes of its own gets a server of its own."""
    from multiprocessing import forkserver as multiprocessing_forkserver

    server = multiprocessing_forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def start_variables(plan: LaunchPlan | None) -> dict[str, str]:
    """`worker_environment.start_variables` of `plan`'s launch."""
    return spec_start_variables(plan.spec if plan is not None else None)


def launch_spawn(job_file: Path, plan: LaunchPlan, rendezvous_at: str,
                 signals: StopSignals) -> tuple[int, list[failures.WorkerExit]]:
    """(exit code, the failures seen first) of N workers started by torch.multiprocessing."""
    # The children inherit SIGINT ignored until run_worker installs their stop handler: a Ctrl-C
    # during their start-up (a terminal sends it to every process) must not kill them half-built.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        context = start_workers(_spawn_entry, (str(job_file), plan, os.getpid()), plan.world_size, plan, join=False)
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
    # The agent's own settings: where it notes failed workers, and no store of its own (it joins ours).
    env.update({EXITS_VARIABLE: str(exits_file), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    # torchrun runs in its own process group: a Ctrl-C here becomes a clean "stop" (every rank stops at
    # the same step and backs up) instead of torchrun's signal handling, which reports a failure.
    proc = subprocess.Popen(cmd, env=env, **_own_process_group())
    signals.attach(lambda signum: _signal_group(proc, signum))
    code = proc.wait()
    if signals.aborted:
        return ABORTED, []
    return code, failures.read_exits(exits_file) if code != 0 else []


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
    agents of the machines still alive rejoin at once, so 10 s only waits for a machine that comes back. The
    rendezvous numbers machines in the order of their `local_addr`, so naming each after its node rank puts
    global rank 0 on node 0, which writes the outputs."""
    spec = plan.spec
    timeout_s = max(1, round(60 * plan.timeout_minutes))
    nodes = f"{spec.min_nodes}:{spec.nnodes}" if spec.min_nodes and spec.min_nodes < spec.nnodes else str(spec.nnodes)
    arguments = [f"--nproc_per_node={spec.processes_here}", f"--nnodes={nodes}", "--rdzv_backend=c10d",
                 f"--rdzv_endpoint={rendezvous_at}",
                 f"--rdzv_conf=is_host=false,join_timeout={timeout_s},last_call_timeout={max(1, min(10, timeout_s // 2))}",
                 f"--rdzv_id=tandem-{plan.master_port}", f"--max_restarts={spec.max_restarts}"]
    if spec.nnodes > 1:
        arguments.append(f"--local_addr=tandem-node-{spec.node_rank:04d}")
    return arguments


def rendezvous_timed_out(exits_file: Path) -> bool:
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
            # Killed with the launcher: the workers then die with it (each has its own parent-death signal).
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    return {"preexec_fn": child_setup}


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signal.CTRL_BREAK_EVENT if signum != HARD_KILL else signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
