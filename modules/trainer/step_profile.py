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

The profiler slows the host (it records every operator), so in a loop near the line between the two
the busy fractions read low: compare them between cases profiled alike, and read the kernel count
per step, which the profiler does not change, as the host's share of the work.

`scripts/benchmark.py --profile DIR` profiles the benchmark's steps; `TANDEM_PROFILE_STEPS=FIRST[:COUNT]`
profiles COUNT (default 5) steps of a real run from step FIRST, on every rank (`RunProfiler`).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch

from modules.util import dist_utils as du
from modules.util.atomic import write_text_atomically

log = logging.getLogger("tandem")

PROFILE_VARIABLE = "TANDEM_PROFILE_STEPS"
DEFAULT_COUNT = 5


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals in microseconds, as seconds: time a device was busy.

    Summing kernel durations instead would count twice where streams overlap (NCCL beside compute),
    and summing the profiler's per-operator table counts each kernel twice (as itself and under the
    operator that launched it).
    """
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total / 1e6


def device_activity(events) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(compute, nccl) intervals of the GPU activities (kernels, copies) among profiler events."""
    from torch.autograd import DeviceType

    compute, nccl = [], []
    for event in events:
        if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue  # user annotations span kernels (and the gaps between them)
        span = (event.time_range.start, event.time_range.end)
        (nccl if "nccl" in event.name.lower() else compute).append(span)
    return compute, nccl


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
        compute, nccl = device_activity(self.profiler.events()) if on_gpu else ([], [])
        busy_s = busy_seconds(compute + nccl)
        fraction = lambda seconds: round(seconds / wall_s, 3) if on_gpu and wall_s > 0 else None  # noqa: E731
        summary = {"steps": steps, "wall_s": round(wall_s, 4),
                   "gpu_busy_s": round(busy_s, 4) if on_gpu else None,
                   # Any kernel running: well below 1 means the GPU waited for the host.
                   "gpu_busy_fraction": fraction(busy_s),
                   # Compute alone: below gpu_busy_fraction where NCCL ran with nothing beside it,
                   # i.e. this rank waited for the others (or for communication it could not overlap).
                   "compute_busy_fraction": fraction(busy_seconds(compute)),
                   "nccl_fraction": fraction(busy_seconds(nccl)),
                   # Kernels (and copies) per step: the host's launch work, the same on any card.
                   "gpu_activities_per_step": round((len(compute) + len(nccl)) / steps) if on_gpu else None,
                   "report": str(report_file)}
        lines = [f"{k}: {v}" for k, v in summary.items()]
        if self.device.type == "cuda":
            lines += ["", "Top operators by GPU time:",
                      averages.table(sort_by="self_cuda_time_total", row_limit=25)]
        lines += ["", "Top operators by host (CPU) time:", averages.table(sort_by="self_cpu_time_total", row_limit=25)]
        write_text_atomically(report_file, "\n".join(lines))  # never through a link in the workspace
        return summary


def profile_steps(text: str) -> tuple[int, int]:
    """`FIRST[:COUNT]` as (first, count); a clear error for anything else."""
    first, _, count = text.strip().partition(":")
    try:
        steps = int(first), int(count) if count else DEFAULT_COUNT
    except ValueError:
        steps = (0, 0)
    if steps[0] < 2 or steps[1] < 1:
        raise ValueError(f"{PROFILE_VARIABLE}={text!r}: expected FIRST[:COUNT] with FIRST at least 2 (the first "
                         f"step warms up) and COUNT at least 1, e.g. {PROFILE_VARIABLE}=100:5")
    return steps


class RunProfiler:
    """Profiles steps `first` .. `first + count - 1` of a run on every rank: each rank writes its report to
    `folder`, and the run's lead logs one line with every rank's GPU busy, compute and NCCL fractions (a rank
    whose NCCL time is large while its compute is short waited for another) and emits a `profile` event."""

    def __init__(self, first: int, count: int, device: torch.device, folder: Path, run_id: str,
                 emit: Callable[..., None]) -> None:
        self.first, self.count, self.device, self.folder, self.run_id, self.emit = first, count, device, folder, run_id, emit
        self.profiler: StepProfiler | None = None

    @classmethod
    def from_environment(cls, device: torch.device, folder: Path, run_id: str,
                         emit: Callable[..., None]) -> RunProfiler | None:
        text = os.environ.get(PROFILE_VARIABLE, "").strip()
        return cls(*profile_steps(text), device, folder, run_id, emit) if text else None

    def after_step(self, step: int) -> None:
        """Called by every rank after each step's work is queued (the same steps everywhere)."""
        if step == self.first - 1:
            self.profiler = StepProfiler(self.device)
            self.profiler.start()
        elif self.profiler is not None and step == self.first + self.count - 1:
            last = self.first + self.count - 1
            report = self.folder / f"{self.run_id}-steps-{self.first}-{last}-rank{du.rank()}.txt"
            summary = self.profiler.stop(self.count, report)
            self.profiler = None
            ranks = du.gather_objects(summary)
            if du.is_main():
                self._report(ranks, last)

    def _report(self, ranks: list[dict], last: int) -> None:
        def percent(value):
            return "-" if value is None else f"{100 * value:.0f}%"
        parts = [f"rank {rank}: {r['wall_s'] / r['steps']:.3f} s a step, GPU busy {percent(r['gpu_busy_fraction'])} "
                 f"(compute {percent(r['compute_busy_fraction'])}, NCCL {percent(r['nccl_fraction'])}), "
                 f"{r['gpu_activities_per_step'] or '-'} kernels a step" for rank, r in enumerate(ranks)]
        log.info("Profile of steps %d-%d: %s; reports in %s", self.first, last, "; ".join(parts), self.folder)
        self.emit("profile", first=self.first, last=last, ranks=ranks)
