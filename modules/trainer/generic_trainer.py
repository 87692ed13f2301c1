"""Training in one process on one device (a GPU or the CPU), as `resolve_device` picks it."""
from __future__ import annotations

import torch

from modules.config.launch_spec import resolve_device
from modules.trainer.base_trainer import BaseTrainer


def pick_device(setting: str) -> torch.device:
    kind, problem = resolve_device(setting, torch.cuda.device_count())
    if problem:
        raise RuntimeError(problem)
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


class GenericTrainer(BaseTrainer):
    def setup_environment(self) -> None:
        self.device = pick_device(self.cfg.general.device)
        self.configure_backends()
