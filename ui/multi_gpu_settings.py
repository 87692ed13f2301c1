"""What the multi-GPU frame's controls write into the config, and read back from it.

GPU check boxes become `multi_gpu.device_indexes` and `num_gpus`; "all" is both empty/0 so that
the config keeps meaning "every visible GPU" on a machine with a different count. The CPU-process
mode used for trying multi-process training without GPUs is `general.device = "cpu"` with
`num_gpus` processes, so the saved config reproduces it from the command line too.
"""
from __future__ import annotations

from typing import Any

from modules.config import TrainConfig
from modules.config.validation import parse_device_indexes

CPU_PROCESS_CHOICES = ("off", "2", "3", "4")


def selected_gpus(cfg: TrainConfig, visible: list[int]) -> list[int]:
    """The visible GPU indexes the config trains on."""
    try:
        indexes = parse_device_indexes(cfg.multi_gpu.device_indexes)
    except ValueError:
        indexes = []
    if indexes:
        return [i for i in indexes if i in visible]
    if cfg.multi_gpu.num_gpus > 0:
        return visible[:cfg.multi_gpu.num_gpus]
    return list(visible)


def gpu_selection_values(selected: list[int], visible: list[int]) -> dict[str, Any]:
    """Field values for a set of ticked GPUs; all of them is stored as "all visible"."""
    chosen = sorted(set(selected))
    if chosen == sorted(visible):
        return {"multi_gpu.device_indexes": "", "multi_gpu.num_gpus": 0}
    return {"multi_gpu.device_indexes": ",".join(str(i) for i in chosen), "multi_gpu.num_gpus": len(chosen)}


def cpu_processes(cfg: TrainConfig) -> str:
    """The CPU-process choice the config holds: "off" or a count."""
    if cfg.general.device != "cpu" or not cfg.multi_gpu.enabled:
        return "off"
    return str(max(cfg.multi_gpu.num_gpus, 2))


def cpu_process_values(choice: str) -> dict[str, Any]:
    if choice not in CPU_PROCESS_CHOICES:
        raise ValueError(f"CPU processes must be one of {', '.join(CPU_PROCESS_CHOICES)}, got {choice!r}")
    if choice == "off":
        return {"general.device": "auto", "multi_gpu.num_gpus": 0, "multi_gpu.device_indexes": ""}
    return {"general.device": "cpu", "multi_gpu.enabled": True, "multi_gpu.num_gpus": int(choice),
            "multi_gpu.device_indexes": ""}
