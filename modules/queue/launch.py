"""What a job runs on the GPUs the scheduler gave it: the config, the command line and the environment.

The job sees only its GPUs: CUDA_VISIBLE_DEVICES names them (numbered by PCI bus, as the GUI and NVML number
them), and the config trains on every GPU it sees - one process for one GPU, one per GPU for several, on a
free rendezvous port so that jobs beside each other never meet. On a machine without GPUs the slots are CPU
processes: a job of N slots trains as N CPU processes.
"""
from __future__ import annotations

import copy
from pathlib import Path

from modules.config import TrainConfig, config_to_dict, read_config
from modules.launch.spec import resolve_launch
from modules.remote.remote_side import backups

from .jobs import Job

REPO = Path(__file__).resolve().parents[2]


def run_config(cfg: TrainConfig, devices: tuple[int, ...] | list[int], cpu_slots: bool) -> TrainConfig:
    """`cfg` trained on exactly the given GPUs (or, `cpu_slots`, as that many CPU processes)."""
    run = copy.deepcopy(cfg)
    m = run.multi_gpu
    count = len(devices)
    m.enabled = count > 1
    m.device_indexes = ""
    m.num_gpus = count if count > 1 else 0
    if m.nnodes == 1:
        m.master_port = 0  # a free port: jobs beside each other must not share a rendezvous
    if cpu_slots and count > 1 and run.general.device == "auto":
        run.general.device = "cpu"
    return run


def resume_argument(job: Job) -> tuple[str | None, str]:
    """What `--resume` continues for this start (None: from the beginning), and a note when the backup the job
    would continue is not there."""
    if not job.resume:
        return None, ""
    found = backups(Path("/"), job.workspace)
    if job.resume != "latest":
        found = [b for b in found if b["run_id"] == job.resume]
    if found:
        return job.resume, ""
    return None, f"no backup of {job.resume} in {job.workspace}: it starts from the beginning"


def run_spec(job: Job, run_id: str, devices: tuple[int, ...], runs_root: Path, cpu_slots: bool) -> tuple[dict, str]:
    """The run's entry for the run registry (`remote_side.start`) and a note for the job (or "")."""
    cfg = run_config(read_config(job.config), devices, cpu_slots)
    resume, note = resume_argument(job)
    launch = resolve_launch(cfg, 0 if cpu_slots else len(devices))
    script = "train_multi_gpu.py" if launch.multi_process and launch.world_size >= 2 else "train.py"
    config_file = runs_root / "runs" / run_id / "config.json"
    env = {**job.env, "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    spec = {"id": run_id, "workspace": job.workspace, "config": config_to_dict(cfg), "cwd": job.cwd,
            "command": [str(REPO / "scripts" / script), "--config-path", str(config_file),
                        *(["--resume", resume] if resume else [])],
            "env": env, "config_name": job.name, "local_workspace": job.workspace, "source": REPO.name,
            "queue_job": job.id, "devices": list(devices), "inherit_home": True}
    return spec, note
