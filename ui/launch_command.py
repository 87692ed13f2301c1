"""The command line that starts training for a config, as the GUI runs it.

Training never runs inside the GUI process: a crash, an OOM or a hung NCCL collective must not
take the window down, and CUDA must not be initialised in a process that later forks.
The command names one file, the config the run uses (`run_config`), and no options that repeat its
values: the launcher resolves that file as the GUI did (`resolve_launch`).
"""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

from modules.config import TrainConfig
from modules.launch.spec import resolve_launch

REPO_ROOT = Path(__file__).resolve().parents[1]
SINGLE_SCRIPT = REPO_ROOT / "scripts" / "train.py"
MULTI_SCRIPT = REPO_ROOT / "scripts" / "train_multi_gpu.py"


def is_multi_process(cfg: TrainConfig, visible_gpus: int) -> bool:
    launch = resolve_launch(cfg, visible_gpus)
    return launch.multi_process and launch.world_size >= 2


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


def run_config(cfg: TrainConfig, visible_gpus: int) -> TrainConfig:
    """The config a start runs: `cfg`, with Multi-GPU turned off when fewer than two processes would run
    (Start asked first, see `start_check`), so that the run's saved config says what it did."""
    if not cfg.multi_gpu.enabled or is_multi_process(cfg, visible_gpus):
        return cfg
    single = copy.deepcopy(cfg)
    single.multi_gpu.enabled = False
    return single


def build_command(cfg: TrainConfig, config_path: str | Path, visible_gpus: int,
                  python: str = sys.executable, resume: str | None = None) -> list[str]:
    """`python scripts/train.py --config-path X`, or `scripts/train_multi_gpu.py` when `cfg` (as
    `run_config` made it) runs several processes: GPUs, launcher, backend and CPU processes are the
    config's. `resume` continues a backup (`--resume`, see modules/trainer/backup.find_backup).
    """
    script = MULTI_SCRIPT if is_multi_process(cfg, visible_gpus) else SINGLE_SCRIPT
    return [python, str(script), "--config-path", str(config_path), *(["--resume", resume] if resume else [])]
