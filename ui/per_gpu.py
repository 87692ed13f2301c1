"""The Run tab's per-GPU table: each rank's loss and images/s next to its GPU's load, memory and heat.

Rank r of a multi-GPU run trains on the r-th chosen GPU (`RunState.rank_gpus`, numbered as NVML and
nvidia-smi number them; the GUI starts training with CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA agrees). The
per-rank numbers come from the trainer's events (`rank_losses`, `rank_images_per_s`), the GPU readings
from NVML in the GUI process. Either may be missing (one process, CPU processes, no NVIDIA driver);
the table then shows what there is.
"""
from __future__ import annotations

from dataclasses import dataclass

from .gpu_info import GpuUsage
from .run_controller import RunState

HEADERS = ("", "Loss", "Images/s", "GPU load", "Memory", "Temp.")


@dataclass(frozen=True)
class PerGpuRow:
    name: str
    loss: str = ""
    images_per_s: str = ""
    load: str = ""
    memory: str = ""
    temperature: str = ""

    def cells(self) -> tuple[str, ...]:
        return (self.name, self.loss, self.images_per_s, self.load, self.memory, self.temperature)


def _usage_cells(usage: GpuUsage | None) -> dict[str, str]:
    if usage is None:
        return {}
    return {"load": f"{usage.utilisation_pct}%",
            "memory": f"{usage.memory_used_mib / 1024:.1f} / {usage.memory_total_mib / 1024:.0f} GiB",
            "temperature": f"{usage.temperature_c} °C" if usage.temperature_c is not None else ""}


def per_gpu_rows(state: RunState, usage: list[GpuUsage]) -> list[PerGpuRow]:
    """One row per rank of the run (with its GPU's readings), then one per GPU that no rank uses."""
    by_index = {u.index: u for u in usage}
    ranks = max(len(state.rank_losses), len(state.rank_images_per_s))
    gpus = state.rank_gpus or []
    rows, used = [], set()
    for rank in range(ranks):
        gpu = gpus[rank] if rank < len(gpus) else None
        used.add(gpu)
        loss = state.rank_losses[rank] if rank < len(state.rank_losses) else None
        rate = state.rank_images_per_s[rank] if rank < len(state.rank_images_per_s) else None
        rows.append(PerGpuRow(
            name=f"Rank {rank} · GPU {gpu}" if gpu is not None else f"Rank {rank} (CPU)",
            loss=f"{loss:.4f}" if loss is not None else "",
            images_per_s=f"{rate:.2f}" if rate else "",
            **_usage_cells(by_index.get(gpu))))
    for u in usage:
        if u.index not in used:
            training = ranks == 0 and state.active and u.index in gpus
            rows.append(PerGpuRow(name=f"GPU {u.index}" + (" (training)" if training else ""), **_usage_cells(u)))
    return rows
