"""The command line that starts training for a config, as the GUI runs it.

Training never runs inside the GUI process: a crash, an OOM or a hung NCCL collective must not
take the window down, and CUDA must not be initialised in a process that later forks.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from modules.config import TrainConfig

from .multi_gpu_summary import world_size

REPO_ROOT = Path(__file__).resolve().parents[1]
SINGLE_SCRIPT = REPO_ROOT / "scripts" / "train.py"
MULTI_SCRIPT = REPO_ROOT / "scripts" / "train_multi_gpu.py"


def is_multi_process(cfg: TrainConfig, visible_gpus: int) -> bool:
    return cfg.multi_gpu.enabled and world_size(cfg, visible_gpus) >= 2


@dataclass(frozen=True)
class StartCheck:
    """What Start must do before running: refuse (with the reason and the fix), ask, or just start."""
    refuse: str | None = None
    ask: str | None = None


def start_check(cfg: TrainConfig, visible_gpus: int) -> StartCheck:
    """Multi-GPU on but fewer than two processes would run: never silently train in one process.

    No GPU at all (and no CPU processes chosen) is refused - the user asked for the multi-process path
    and this machine cannot give it without the CPU mode. One GPU is asked about: training in one
    process there is a sensible thing to want.
    """
    if not cfg.multi_gpu.enabled or cfg.general.device == "cpu":
        return StartCheck()
    where = "Training tab, Multi-GPU"
    if visible_gpus == 0:
        return StartCheck(refuse=(
            f"Multi-GPU training is on, but no GPU is visible here. Turn Multi-GPU off to train in one process "
            f"on the CPU, or choose CPU processes ({where}) to try the multi-process path on the CPU."))
    if is_multi_process(cfg, visible_gpus):
        return StartCheck()
    if visible_gpus == 1:
        situation = "this machine has one GPU"
    else:
        situation = f"only one of its {visible_gpus} GPUs is ticked ({where})"
    return StartCheck(ask=f"Multi-GPU training is on, but {situation}. Train in one process on that GPU?")


def build_command(cfg: TrainConfig, config_path: str | Path, visible_gpus: int,
                  python: str = sys.executable, resume: str | None = None) -> list[str]:
    """`python scripts/train.py --config-path X`, or the multi-process launcher with the options
    of the multi-GPU frame spelled out, so that the log shows exactly what was started.

    CPU processes (the frame's "for trying" mode) are `general.device = "cpu"` with
    `multi_gpu.num_gpus` processes; they launch with `--device cpu`. `resume` continues a backup
    (`--resume`, see modules/trainer/backup.find_backup).
    """
    tail = ["--resume", resume] if resume else []
    if not is_multi_process(cfg, visible_gpus):
        command = [python, str(SINGLE_SCRIPT), "--config-path", str(config_path), *tail]
        if cfg.multi_gpu.enabled:  # one process after all (see start_check): the run's config says so
            command += ["--config-value", "multi_gpu.enabled=false"]
        return command
    m = cfg.multi_gpu
    command = [python, str(MULTI_SCRIPT), "--config-path", str(config_path),
               "--num-gpus", str(world_size(cfg, visible_gpus))]
    if m.launcher == "spawn":
        command.append("--spawn")
    if m.master_port:
        command += ["--port", str(m.master_port)]
    if cfg.general.device == "cpu":
        command += ["--device", "cpu"]
    elif m.backend != "auto":
        command += ["--distributed-backend", m.backend]
    if m.distributed_data_loading:
        command.append("--distributed-data-loading")
    return command + tail
