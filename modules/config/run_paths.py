"""Where a run writes its files, derived from the config in one place."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .train_config import TrainConfig


@dataclass(frozen=True, init=False)
class RunPaths:
    """The folders and files of one run. Relative paths stay relative to the current directory."""

    workspace: Path
    cache: Path
    output_dir: Path
    backups: Path
    samples: Path
    tensorboard: Path
    commands_file: Path
    """Commands from the GUI (stop, sample, backup, save), one line each, read by rank 0."""
    configs: Path
    """Where rank 0 writes the resolved config of each run at start (`<run id>.json`); never a user's file."""

    def __init__(self, cfg: TrainConfig):
        workspace = Path(cfg.general.workspace_dir).expanduser()
        values = {
            "workspace": workspace,
            "cache": Path(cfg.general.cache_dir).expanduser() if cfg.general.cache_dir else workspace / "cache",
            "output_dir": Path(cfg.save.output_dir).expanduser() if cfg.save.output_dir else workspace / "output",
            "backups": workspace / "backups",
            "samples": workspace / "samples",
            "tensorboard": workspace / "tensorboard",
            "commands_file": workspace / ".tandem" / "commands",
            "configs": workspace / "config",
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
