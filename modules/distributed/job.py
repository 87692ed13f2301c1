"""The job a launcher hands its workers: one object, written as one file (`<workspace>/.tandem/launch.json`).

Everything a worker needs besides the standard torchrun variables (RANK, WORLD_SIZE, ...) and what
torchrun's agent sets per round is in it: the validated config and the launch resolved from it, the backup
to continue and the run's id, the launcher's scan of the data (so no worker scans again or repeats its
warnings), where the rendezvous store listens, where this run's commands start in the commands file,
whether the launcher holds the workspace, where torchrun's agent notes failed workers, and the launch
clocks for the start-up report. A worker that someone else's torchrun started makes its own
(`worker.external_worker_job`), with what no launcher decided left empty.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from modules.config import RunPaths, TrainConfig, config_from_dict, config_to_dict
from modules.launch.spec import LaunchSpec
from modules.util.atomic import write_text_atomically

JOB_FILE = "launch.json"
"""The job's file, in `<workspace>/.tandem/`; written for each launch, read by every worker."""


@dataclasses.dataclass(frozen=True)
class WorkerJob:
    """Everything a worker needs besides the torchrun variables."""
    cfg: TrainConfig
    spec: LaunchSpec
    resume: str | None = None
    run_id: str | None = None
    """The run's id when the launcher decided it (None: rank 0 decides, as in one process)."""
    launched_at: float = 0.0
    """When the launch began (seconds since the epoch): a backup of `run_id` written since then was written
    by this launch's workers, so a restarted round continues from it."""
    scan: object | None = None
    """The launcher's scan of the data (`modules.data.ScanResult`); None: the worker scans (a user's torchrun)."""
    rendezvous: str | None = None
    """`host:port` of the store the launcher serves; None: MASTER_ADDR/MASTER_PORT, as PyTorch does."""
    commands_from: int | None = None
    """Byte offset of the commands file from which commands are this run's (taken before the workers started,
    so that a stop written during their start-up counts); None: its end when the worker opens it."""
    workspace_held: bool = False
    """Whether the launcher holds the workspace for the run (then each worker holds a lock of its own)."""
    exits_file: str | None = None
    """Where torchrun's agent notes how failed workers ended (a restarted round reads the round before)."""
    clock: dict = dataclasses.field(default_factory=dict)
    """When the command started and when it started the workers (`util.launch_clock.marks`)."""


def job_file_name(node_rank: int) -> str:
    """Each machine's job differs (its node rank): with a shared workspace they must not share a file."""
    return JOB_FILE if node_rank == 0 else f"launch-node-{node_rank}.json"


def job_path(cfg: TrainConfig, node_rank: int) -> Path:
    return RunPaths(cfg).workspace / ".tandem" / job_file_name(node_rank)


def write_job(job: WorkerJob) -> Path:
    path = job_path(job.cfg, job.spec.node_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"config": config_to_dict(job.cfg), "launch": job.spec.as_dict(), "resume": job.resume,
            "run_id": job.run_id, "launched_at": job.launched_at,
            "scan": job.scan.to_dict() if job.scan is not None else None, "rendezvous": job.rendezvous,
            "commands_from": job.commands_from, "workspace_held": job.workspace_held, "exits_file": job.exits_file,
            "clock": job.clock}
    write_text_atomically(path, json.dumps(data, separators=(",", ":")))  # read by programs; a scan can be long
    return path


def read_job(path: str | os.PathLike) -> WorkerJob:
    from modules.data.concepts import ScanResult

    data = json.loads(Path(path).read_text(encoding="utf-8"))
    scan = data.get("scan")
    return WorkerJob(config_from_dict(data["config"], source=str(path)), LaunchSpec.from_dict(data["launch"]),
                     data["resume"], data.get("run_id"), data.get("launched_at", 0.0),
                     ScanResult.from_dict(scan) if scan is not None else None, data.get("rendezvous"),
                     data.get("commands_from"), data.get("workspace_held", False), data.get("exits_file"),
                     data.get("clock", {}))
