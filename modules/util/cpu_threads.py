"""How many threads PyTorch's CPU kernels get: each process its share of the cores it may run on, and in a
one-process CPU run no more than other work leaves idle. Torch-free: the spawn launcher decides its workers'
share before it imports PyTorch.

PyTorch starts one thread per core. Its kernels split each operation over all of them and wait for the
slowest at the end of every one, so a thread that another process keeps off its core stalls the others. On
a busy 2-core machine a 3-step `#demo` run on the CPU took 56 s with PyTorch's 2 threads against 17 s with
one (issue 54); its 3 samples - thousands of small operations - took 62.3 s against 1.7 s at a load of 5.6
(measured 2026-12-02 on this repository's 2-core development machine).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

THREADS_VARIABLE = "OMP_NUM_THREADS"
"""The user's own choice of threads, which PyTorch reads when it starts and Tandem never overrides."""

CGROUP_V2_QUOTA = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def affinity_cores() -> int:
    """The cores this process may be scheduled on (all of the machine's where the OS cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def quota_cores() -> float | None:
    """A container's CPU quota in cores (`docker run --cpus 2`: 2.0), None without one. PyTorch's own count
    and the affinity both see every core of the host."""
    try:
        quota, period = CGROUP_V2_QUOTA.read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(CGROUP_V1_QUOTA.read_text())
        return quota_us / int(CGROUP_V1_PERIOD.read_text()) if quota_us > 0 else None
    except (OSError, ValueError, ZeroDivisionError):
        return None


def usable_cores() -> int:
    """The cores this process may run on: its affinity, lowered to a container's quota (rounded up)."""
    cores = affinity_cores()
    quota = quota_cores()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def threads_per_worker(local_world: int) -> int:
    """Each of the host's `local_world` workers gets this share of the cores it may run on.

    By default every process starts one thread per core; N workers would then oversubscribe the host
    N times, and the busy threads delay the launch thread that keeps each GPU fed.
    """
    return max(1, usable_cores() // max(1, local_world))


def busy_fraction(load: float, machine_cores: int) -> float:
    """How much of the machine other processes keep busy (0-1): the last minute's load average less one
    runnable task for this process itself (it has been importing), per core of the machine."""
    return min(1.0, max(0.0, load - 1.0) / max(1, machine_cores))


def one_process_cpu_threads(load: float | None = None) -> tuple[int, str]:
    """Threads for a one-process run on the CPU and why, for its log: the process's share of the cores (all it
    may use, as the launcher's `threads_per_worker(1)`), less those other work keeps busy - at least one.
    `load`: the load average to judge by (None: the system's now; 0 where it has none, e.g. Windows)."""
    share = threads_per_worker(1)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):
            load = 0.0
    busy = busy_fraction(load, os.cpu_count() or share)
    threads = max(1, min(share, round(share * (1.0 - busy))))
    if threads == share:
        return threads, f"one per core this process may use; {THREADS_VARIABLE} sets another number"
    return threads, (f"of {share} usable cores: other work keeps {busy:.0%} of the machine busy (load {load:.1f}), "
                     f"and each kernel waits for its slowest thread; {THREADS_VARIABLE} sets another number")
