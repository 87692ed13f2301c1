"""Profile a few training steps: is the loop GPU-bound, or does the GPU wait for the host?

The benchmark's timings cannot tell these apart: when the host launches kernels faster than the GPU
runs them, the CUDA launch queue fills and launching blocks, so in both cases the host spends the
whole step "launching". The profiler's device time can: if the GPU is busy for nearly the whole wall
time of the profiled steps the loop is GPU-bound (faster kernels, less communication help); if not,
the gaps are host time (fewer, larger kernels help: torch.compile, CUDA graphs).

On N GPUs every rank profiles itself. NCCL kernels are counted apart from the compute kernels: a
collective's kernel runs (spins) until the slowest rank joins it, so a rank whose NCCL time is large
while its compute time is short waits for another rank - the straggler is the rank with the least
NCCL time.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch


def _device_time_us(event) -> float:
    # Renamed from self_cuda_time_total in newer torch releases.
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))


class StepProfiler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.started = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def start(self) -> None:
        self._sync()
        self.profiler.start()
        self.started = time.perf_counter()

    def stop(self, steps: int, report_file: Path) -> dict:
        """Stop after `steps` steps; write the op tables to `report_file` and return the summary."""
        self._sync()
        wall_s = time.perf_counter() - self.started
        self.profiler.stop()
        averages = self.profiler.key_averages()
        on_gpu = self.device.type == "cuda"
        device_s = sum(_device_time_us(e) for e in averages) / 1e6
        nccl_s = sum(_device_time_us(e) for e in averages if "nccl" in e.key.lower()) / 1e6
        fraction = lambda seconds: round(seconds / wall_s, 3) if on_gpu and wall_s > 0 else None  # noqa: E731
        summary = {"steps": steps, "wall_s": round(wall_s, 4),
                   "gpu_busy_s": round(device_s, 4) if on_gpu else None,
                   # Kernels on several streams (NCCL beside compute) can overlap, so this may exceed 1.
                   "gpu_busy_fraction": fraction(device_s),
                   # Compute alone: well below 1 means the GPU waited (for the host, or for the other ranks).
                   "compute_busy_fraction": fraction(device_s - nccl_s),
                   "nccl_fraction": fraction(nccl_s),
                   "report": str(report_file)}
        lines = [f"{k}: {v}" for k, v in summary.items()]
        if self.device.type == "cuda":
            lines += ["", "Top operators by GPU time:",
                      averages.table(sort_by="self_cuda_time_total", row_limit=25)]
        lines += ["", "Top operators by host (CPU) time:", averages.table(sort_by="self_cpu_time_total", row_limit=25)]
        report_file.parent.mkdir(parents=True, exist_ok=True)
        report_file.write_text("\n".join(lines), encoding="utf-8")
        return summary
