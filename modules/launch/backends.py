"""Which communication backend a run uses, and whether it can work here.

Torch-free on purpose: the GUI checks a config before Start without importing training code, and the
launcher and the machine check (`scripts/check_multi_gpu.py`) ask the same questions.
"""
from __future__ import annotations

import platform

from modules.config import TrainConfig


def resolve_backend(requested: str, device_type: str) -> str:
    """auto = NCCL for CUDA on Linux, gloo otherwise (CPU processes, Windows, macOS)."""
    if requested == "auto":
        return "nccl" if device_type == "cuda" and platform.system() == "Linux" else "gloo"
    if requested == "nccl" and device_type != "cuda":
        raise RuntimeError("multi_gpu.backend is 'nccl' but this run has no CUDA GPU: use 'gloo' or 'auto'.")
    if requested == "nccl" and platform.system() == "Windows":
        raise RuntimeError("multi_gpu.backend is 'nccl', but PyTorch's Windows builds have no NCCL: "
                           "use 'gloo' or 'auto' (which picks gloo on Windows).")
    return requested


def backend_problem(cfg: TrainConfig, visible_gpus: int) -> str | None:
    """Why `cfg`'s multi-GPU backend cannot run on a machine with `visible_gpus` CUDA GPUs, or None.

    Only NCCL has requirements: CUDA GPUs (not CPU processes) and Linux (PyTorch builds NCCL for Linux only).
    """
    m = cfg.multi_gpu
    if not m.enabled or m.backend != "nccl":
        return None
    if cfg.general.device == "cpu":
        return ("multi_gpu.backend: 'nccl' needs CUDA GPUs, but general.device is 'cpu' (CPU processes); "
                "set multi_gpu.backend to 'gloo' or 'auto'.")
    if visible_gpus < 1:
        return ("multi_gpu.backend: 'nccl' needs CUDA GPUs, but none is visible here; set multi_gpu.backend "
                "to 'gloo' or 'auto' (and general.device to 'cpu' to try CPU processes), or check the driver.")
    if platform.system() != "Linux":
        return (f"multi_gpu.backend: 'nccl' is only available on Linux (this is {platform.system()}); "
                "set multi_gpu.backend to 'gloo' or 'auto'.")
    return None
