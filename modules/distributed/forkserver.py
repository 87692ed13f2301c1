"""The spawn launcher's forkserver (Linux): the process that imports what every worker needs once, and from
which each worker is forked (`processes.start_workers`).

Its imports are the largest part of a multi-GPU launch (7.0-8.8 s on H200 hosts: "the forkserver's imports" in
docs/perf/2026-11-28-h200x4.jsonl and 2026-11-29-h200x2.jsonl), so the launcher starts it as early as it can:
before importing PyTorch itself (`start_before_imports`, from the config and the GPUs NVML counts), so that
the server imports while the launcher imports and checks the job. A server is kept only where it was started
with the values the workers' start asks for (`keep_or_replace`);
a guess that turns out wrong costs a second server, never a worker with the wrong GPUs or threads.

No torch here, for that reason.
"""
from __future__ import annotations

import os
import platform
import sys
import time

from modules.config import TrainConfig
from modules.distributed.worker_environment import environment, start_variables
from modules.launch.spec import SPAWN, resolve_launch
from modules.util import launch_clock
from modules.util.exit import stop_multiprocessing_forkserver

PRELOADED = ("modules.distributed.forkserver_setup", "modules.distributed.worker",
             "modules.distributed.distributed_trainer", "modules.model.loading", "diffusers.models.modeling_utils",
             "transformers.modeling_utils", "peft")
"""What every worker imports before its first step (the trainer, torch, diffusers' and transformers' model
machinery, peft: ~6 CPU-s on a 2-core host): the server imports it once and each worker starts as a copy of
it. The first module prepares the server for that (forkserver_setup.py: no CUDA, SIGTERM ignored)."""

LAUNCHER_ENTRY_MODULE = "modules.distributed.processes"
"""Where the spawn launcher's worker entry lives (`processes._spawn_entry`): the server imports it too."""

READ_AT_IMPORT = ("OMP_", "MKL_", "KMP_", "GOMP_", "CUDA_", "NCCL_", "NVIDIA_", "TORCH", "PYTORCH", "PYTHON", "HF_",
                  "TRANSFORMERS_", "DIFFUSERS_", "USE_LIBUV", "LD_")
"""Variables read while torch, CUDA, OpenMP, Python or the Hugging Face libraries import or initialise: the
server's values are its workers' whatever their own environment says."""

_server_started_with: tuple | None = None
"""What this process's server was started with (`keep_or_replace`)."""


def start_method() -> str:
    """How torch.multiprocessing starts the workers: from a forkserver on Linux, spawned elsewhere.

    Spawned workers each import torch and the model libraries anew, all at the same time, contending for the
    cores: 3 steps of the demo on 2 CPU processes took 21.6-22.7 CPU-s spawned and 14.6-15.6 forked (2 cores);
    on 2x H200 the imports moved from 7.8-8.3 s of each rank's start into the server (2026-11-28, the
    `forkserver-launch` lines of docs/perf/2026-11-28-h200x2.jsonl). A forkserver (Python's `multiprocessing`
    start method) imports them once and forks each worker from itself. Windows has no fork; macOS's system
    libraries are not safe to fork."""
    return "forkserver" if platform.system() == "Linux" else "spawn"


def preload_for(entry_module: str) -> list[str]:
    return [*PRELOADED, entry_module]


def keep_or_replace(preload: list[str], environ: dict[str, str]) -> None:
    """Keep this process's server if it was started with `preload`, this `sys.path` and `environ`'s
    `READ_AT_IMPORT` variables; else end it and prepare the next one (started by the next worker's start).
    A kept server that died meanwhile is started again by multiprocessing, under these same values."""
    import multiprocessing
    from multiprocessing import forkserver as multiprocessing_forkserver

    global _server_started_with
    wanted = (tuple(preload), tuple(sys.path),
              tuple(sorted((k, v) for k, v in environ.items() if k.startswith(READ_AT_IMPORT))))
    running = getattr(multiprocessing_forkserver._forkserver, "_forkserver_pid", None) is not None
    if running and _server_started_with == wanted:
        return
    stop()
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    _server_started_with = wanted


def start_now(preload: list[str], variables: dict[str, str]) -> bool:
    """Start a server importing `preload` under `variables` (the workers' GPUs, threads) now, unless one
    started with those values runs already; returns at once, the server imports on its own. Whether one was
    started: the start-up report then counts its imports as running beside the launcher's."""
    from multiprocessing import forkserver as multiprocessing_forkserver

    keep_or_replace(preload, {**os.environ, **variables})
    running, starting_at = multiprocessing_forkserver._forkserver._forkserver_pid, time.time()
    with environment(variables):
        multiprocessing_forkserver.ensure_running()
    if multiprocessing_forkserver._forkserver._forkserver_pid == running:
        return False
    launch_clock.note_forkserver_started(starting_at)
    return True


def stop() -> None:
    """End this process's server, if it started one (its workers have ended)."""
    stop_multiprocessing_forkserver()


def start_before_imports(cfg: TrainConfig) -> bool:
    """Start the server for the workers `cfg` will launch here, before this launcher imports PyTorch: its
    imports then run beside the launcher's own and its checks. Only for the spawn launcher on a system with
    a forkserver, and where the number of GPUs is known without PyTorch (NVML; CPU processes need none).
    The launch plans again with PyTorch's count (`launch` -> `processes.start_forkserver_now`) and keeps this
    server only if it was started with the same values. Whether one was started."""
    if start_method() != "forkserver":
        return False
    gpus = 0 if cfg.general.device == "cpu" else gpus_visible_without_torch()
    if gpus is None:
        return False
    spec = resolve_launch(cfg, gpus, cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    if spec.problem or spec.launcher != SPAWN:
        return False
    return start_now(preload_for(LAUNCHER_ENTRY_MODULE), start_variables(spec))


def gpus_visible_without_torch() -> int | None:
    """The CUDA GPUs this process may use, as NVML (nvidia-ml-py, as the GUI's `ui/gpu_info.py` uses it) counts
    them and CUDA_VISIBLE_DEVICES narrows them; None where NVML cannot tell (not installed, no NVIDIA driver).
    Only a forecast of what PyTorch will count: a wrong one costs a second server, not a wrong launch
    (`keep_or_replace`)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - not installed, no driver or no GPU: the launch starts the server later
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return count
    return min(count, len([entry for entry in visible.split(",") if entry.strip()]))
