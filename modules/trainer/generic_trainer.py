"""Training in one process on one device (a GPU or the CPU), as `resolve_device` picks it."""
from __future__ import annotations

import torch

from modules.launch.spec import resolve_device
from modules.trainer.base_trainer import BaseTrainer
from modules.trainer.one_gpu_plan import layer_offload_blocks, plan_one_gpu
from modules.trainer.parallelism import SingleProcess


def pick_device(setting: str) -> torch.device:
    kind, problem = resolve_device(setting, torch.cuda.device_count())
    if problem:
        raise RuntimeError(problem)
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


class GenericTrainer(BaseTrainer):
    memory_plan = None
    """The one-GPU memory plan the run trains (`one_gpu_plan.py`), None where none was made."""

    def setup_environment(self) -> None:
        self.device = pick_device(self.cfg.general.device)
        self.configure_backends()
        # Before the model loads: a config that fits nothing is refused now, and the plan decides where it loads.
        self.memory_plan = plan_one_gpu(self.cfg, self.device)
        if self.memory_plan is not None:
            self.cfg = self.memory_plan.apply(self.cfg)
        self.parallel = SingleProcess(layer_offload_blocks(self.cfg))
        self.parallel.offload_activations(self.cfg.training, self.cfg.multi_gpu.activation_offload, self.device)
