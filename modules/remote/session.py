"""The steps of a remote start, in order, for the command line and the GUI alike.

1. every machine checked, and Tandem installed or updated there at the desktop's version (`prepare`);
2. the config made into the remote one (`remote_config`), per machine its node number when there are
   several (node 0's address as the rendezvous, a fixed port), and checked as the launcher will check it;
3. uploads planned by content hash; a large one is announced with its sizes and waits for `confirm`;
4. the run started detached on every machine under one run id, node 0 first.
Progress goes to `progress` as lines a user reads. Machines are prepared and uploaded to side by side.
"""
from __future__ import annotations

import copy
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from modules.config import TrainConfig, config_to_dict, validate
from modules.launch.spec import resolve_launch

from .host import RemoteHost, environment_pairs
from .known_hosts import KnownHosts, ScannedKey, scan
from .machine import RemoteMachine
from .prepare import Report, SetupError, check, ensure_ready
from .remote_config import RemotePlan, remote_plan
from .runs import RunInfo, list_runs, new_run_id, newest_backup, node_run_id, start_run
from .source import Source, local_source
from .ssh import SshError
from .uploads import HashCache, UploadPlan, plan_uploads, send

DEFAULT_RENDEZVOUS_PORT = 29500


class StartRefused(RuntimeError):
    """The user declined (a large upload), or the remote already runs in that workspace."""


@dataclass(frozen=True)
class Started:
    run_id: str
    machines: tuple[RemoteMachine, ...]
    """Node order: node 0 first; its output carries the run's events."""
    infos: tuple[RunInfo, ...]
    workspace: str
    reports: tuple[Report, ...]


def _each(machines, work):
    """`work(machine)` for every machine side by side; results in order; the first error is raised after all ended."""
    if len(machines) == 1:
        return [work(machines[0])]
    with ThreadPoolExecutor(len(machines)) as pool:
        futures = [pool.submit(work, m) for m in machines]
    return [f.result() for f in futures]


def host_keys(machine: RemoteMachine) -> list[ScannedKey]:
    """The keys the machine offers, for the question whether to trust it (`known_hosts.accept`)."""
    return scan(machine.host.host, machine.host.port)


def node_configs(cfg: TrainConfig, count: int, master_addr: str, master_port: int) -> list[TrainConfig]:
    """One config per machine: several machines train as nodes 0..count-1 with node 0's rendezvous."""
    if count == 1:
        return [cfg]
    configs = []
    for rank in range(count):
        node = copy.deepcopy(cfg)
        m = node.multi_gpu
        m.enabled, m.nnodes, m.node_rank = True, count, rank
        m.master_addr, m.master_port = master_addr, master_port or DEFAULT_RENDEZVOUS_PORT
        configs.append(node)
    return configs


def training_command(cfg: TrainConfig, gpus: int, source: Source, run_id: str, resume: str | None) -> list[str]:
    """The command after the Python: scripts/train_multi_gpu.py when the start runs several processes on that
    machine or there are several machines, else scripts/train.py (as the GUI chooses for a local start)."""
    launch = resolve_launch(cfg, gpus)
    multi = cfg.multi_gpu.nnodes > 1 or (launch.multi_process and launch.world_size >= 2)
    script = "train_multi_gpu.py" if multi else "train.py"
    return [f"source/{source.version}/scripts/{script}", "--config-path", f"runs/{run_id}/config.json",
            *(["--resume", resume] if resume else [])]


class RemoteSession:
    def __init__(self, hosts: list[RemoteHost], known: KnownHosts | None = None,
                 progress: Callable[[str], None] = print, confirm: Callable[[str], bool] = lambda text: True,
                 source: Source | None = None, hashes: HashCache | None = None):
        if not hosts:
            raise ValueError("no remote machine given")
        self.machines = tuple(RemoteMachine(h, known) for h in hosts)
        self.progress, self.confirm = progress, confirm
        self._source, self.hashes = source, hashes

    @property
    def source(self) -> Source:
        if self._source is None:
            self._source = local_source()
        return self._source

    def check(self) -> list[Report]:
        """The set-up report of every machine (nothing installed); SshError when one cannot be reached."""
        return _each(self.machines, lambda m: check(m, self.source))

    def plans(self, cfg: TrainConfig, master_addr: str | None = None, master_port: int = 0) -> list[RemotePlan]:
        """The remote config of each machine (node k on machine k), checked as its launcher will check it."""
        configs = node_configs(cfg, len(self.machines), master_addr or self.machines[0].host.host,
                               master_port or cfg.multi_gpu.master_port)
        plans = [remote_plan(c, m.host) for c, m in zip(configs, self.machines)]
        if len({p.config.model.base_model for p in plans}) > 1:
            raise SetupError("several machines must train the same base model: give each the same remote base "
                             "model path (or none, to upload the desktop's)")
        for machine, plan in zip(self.machines, plans):
            problems = validate(plan.config, check_paths=False)
            if problems:
                raise SetupError(f"the config as {machine.label} would run it: " + "; ".join(problems))
        return plans

    def start(self, cfg: TrainConfig, resume: str | None = None, name: str = "run",
              master_addr: str | None = None, master_port: int = 0) -> Started:
        plans = self.plans(cfg, master_addr, master_port)
        reports = self._ready()
        for machine, plan, report in zip(self.machines, plans, reports):
            launch = resolve_launch(plan.config, report.gpu_count)
            if launch.problem:
                raise SetupError(f"{machine.label} ({report.gpu_count} GPU(s)): {launch.problem}")
            if plan.config.multi_gpu.nnodes == 1 and not (launch.multi_process and launch.world_size >= 2):
                plan.config.multi_gpu.enabled = False  # one process there: the run's saved config says so
        if resume and len(self.machines) > 1:
            self._check_backups_everywhere(plans[0].workspace)
        busy = [(m, r) for m in self.machines for r in list_runs(m) if r.active and r.workspace == plans[0].workspace]
        if busy:
            machine, run = busy[0]
            raise StartRefused(f"{machine.label} is still running {run.describe()} in this workspace: attach to it "
                               "and stop it, or wait until it ends")
        self._upload(plans)
        run_id = new_run_id(name)
        infos = []
        hosts = [m.label for m in self.machines]
        for rank, (machine, plan, report) in enumerate(zip(self.machines, plans, reports)):
            spec = {"id": node_run_id(run_id, rank), "workspace": plan.workspace, "config": config_to_dict(plan.config),
                    "command": training_command(plan.config, report.gpu_count, self.source, node_run_id(run_id, rank),
                                                resume),
                    "env": environment_pairs(machine.host.environment), "config_name": name,
                    "local_workspace": str(Path(cfg.general.workspace_dir).expanduser().resolve()),
                    "desktop": socket.gethostname(), "hosts": hosts, "node_rank": rank, "nnodes": len(self.machines),
                    "source": self.source.version, "resume": resume}
            self.progress(f"starting the run on {machine.label}" + (f" (node {rank})" if len(hosts) > 1 else ""))
            infos.append(start_run(machine, spec))
        return Started(run_id, self.machines, tuple(infos), plans[0].workspace, tuple(reports))

    def prepare_job(self, cfg: TrainConfig) -> tuple[RemotePlan, Report]:
        """Steps 1-3 for a job of the machine's queue (one machine): Tandem there at this version, the remote
        config checked, its data and models uploaded. The queue there starts it, on the GPUs it assigns."""
        if len(self.machines) != 1:
            raise SetupError("a queue is one machine's: give one machine")
        plans = self.plans(cfg)
        reports = self._ready()
        self._upload(plans, "nothing was queued")
        return plans[0], reports[0]

    def _ready(self) -> list[Report]:
        return _each(self.machines, lambda m: ensure_ready(m, self.source, self.progress))

    def _upload(self, plans: list[RemotePlan], declined: str = "nothing was started") -> None:
        uploads = _each(list(zip(self.machines, plans)), lambda mp: self._plan_uploads(*mp))
        large = [(m, u) for m, u in zip(self.machines, uploads) if u.large]
        if large and not self.confirm("\n".join(u.message(m.label) for m, u in large) + "\nUpload now?"):
            raise StartRefused(f"the upload was declined; {declined}")
        _each(list(zip(self.machines, uploads)), lambda mu: self._send(*mu))

    def _check_backups_everywhere(self, workspace: str) -> None:
        """Every machine's ranks read the backup they continue from: each remote folder must hold it."""
        found = _each(self.machines, lambda m: newest_backup(m, workspace))
        if found[0] is None:
            raise SetupError(f"{self.machines[0].label} holds no backup of this workspace to continue from")
        lacking = [m.label for m, b in zip(self.machines, found) if b is None or b["step"] != found[0]["step"]]
        if lacking:
            raise SetupError(
                f"continuing on several machines needs node 0's backup (step {found[0]['step']}) on every machine, "
                f"and {', '.join(lacking)} lack it: every rank reads it. Give the machines a remote folder on "
                "shared storage (NFS and the like), or start anew")

    def _plan_uploads(self, machine: RemoteMachine, plan: RemotePlan) -> UploadPlan:
        if plan.uploads:
            self.progress(f"comparing the data and models with {machine.label}")
        return plan_uploads(machine, plan.uploads, self.hashes)

    def _send(self, machine: RemoteMachine, plan: UploadPlan) -> None:
        self.progress(plan.message(machine.label))
        send(machine, plan, self.progress)


__all__ = ["RemoteSession", "Started", "StartRefused", "SetupError", "SshError", "host_keys", "node_configs",
           "training_command"]
