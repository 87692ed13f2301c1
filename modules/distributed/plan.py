"""Planning a multi-process launch: everything decided and checked before any worker starts.

`plan_launch` takes the launch `resolve_launch` makes of the config on this machine (as the GUI previewed
it) and adds where its rendezvous listens; `check_data_fits` scans the data once - the workers get the
scan in their job (`job.py`) and never scan again - and fails when it cannot fill a global batch;
`with_restart_backups` and `run_id_for` decide what restarted workers need to find their place. Every
problem is a `LaunchError` whose message says what to change.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from modules.config import RunPaths, TrainConfig
from modules.config.train_config import MultiGPUConfig
from modules.launch.spec import LaunchSpec, resolve_launch
from modules.preflight import PreflightError
from modules.util.ports import find_free_port, port_is_free

log = logging.getLogger("tandem")
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


def check_data_fits(cfg: TrainConfig, spec: LaunchSpec):
    """The scanned dataset; fails before any worker starts when the data cannot fill one global batch per step
    (`modules/preflight.check_data`, as a one-process run checks it). The scan's warnings (what it skipped,
    resized or ignored) are given here, once for the run."""
    from modules.preflight import check_data
    from modules.trainer.run_numbers import derive_run_numbers

    try:
        dataset = check_data(cfg, spec.data_world)
    except PreflightError as e:
        raise LaunchError(str(e), e.in_window) from None
    try:  # the launch's global batch and the one the workers derive are one
        from modules.data import BucketBatchSampler
        sampler = BucketBatchSampler(dataset.buckets, cfg.training.batch_size, world_size=spec.data_world, rank=0,
                                     seed=cfg.general.seed)
        derive_run_numbers(cfg, spec.data_world, len(sampler), launch=spec)
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
