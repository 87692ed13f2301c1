"""Training in one process on one device (GPU, Apple MPS or CPU)."""
from __future__ import annotations

import torch

from modules.trainer.base_trainer import BaseTrainer


def pick_device(setting: str) -> torch.device:
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("general.device is 'cuda' but torch sees no CUDA GPU: set it to 'auto' or 'cpu', "
                               "or install a CUDA build of torch.")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class GenericTrainer(BaseTrainer):
    def setup_environment(self) -> None:
        self.device = pick_device(self.cfg.general.device)
        self.configure_backends()
