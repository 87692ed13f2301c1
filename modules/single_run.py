"""Training in one process (`scripts/train.py` outside torchrun): no process group, no launcher.

The same checks a launch makes before its workers start (`preflight`, `check_data`), the workspace taken for the run,
Ctrl-C / SIGTERM as a clean stop (`CommandInbox`), then `GenericTrainer`. The multi-process path is
`modules/distributed/launch.py`; both train with the same loop (`trainer/base_trainer.py`).
"""
from __future__ import annotations

import logging

from modules.config import RunPaths, TrainConfig
from modules.preflight import check_data, preflight
from modules.util.logs import setup_logging
from modules.util.workspace_lock import WorkspaceBusy, WorkspaceLock

log = logging.getLogger("tandem")


def use_cpu_threads(device_setting: str) -> None:
    """On the CPU, PyTorch's threads as `cpu_threads.one_process_cpu_threads` chooses them (unless
    OMP_NUM_THREADS chose), said in the log; a run on a GPU keeps PyTorch's own number."""
    import os

    import torch

    from modules.launch.spec import resolve_device
    from modules.util.cpu_threads import THREADS_VARIABLE, one_process_cpu_threads
    kind, _ = resolve_device(device_setting, torch.cuda.device_count())
    if kind != "cpu":
        return
    if os.environ.get(THREADS_VARIABLE, "").strip():
        log.info("CPU threads: %d (%s=%s).", torch.get_num_threads(), THREADS_VARIABLE, os.environ[THREADS_VARIABLE])
        return
    threads, why = one_process_cpu_threads()
    torch.set_num_threads(threads)
    log.info("CPU threads: %d (%s).", torch.get_num_threads(), why)


def run_single(cfg: TrainConfig, resume: str | None = None) -> int:
    """Train `cfg` in this process; the exit code (2: the workspace is in use). Errors are raised, after the
    GUI's `error` event."""
    from modules.trainer.callbacks import default_callbacks
    from modules.trainer.commands import CommandInbox
    from modules.trainer.generic_trainer import GenericTrainer

    setup_logging()
    preflight(cfg)  # raises PreflightError, whose message is the whole story
    scan = check_data(cfg).scan()  # data that fills no step is refused before the model loads
    use_cpu_threads(cfg.general.device)
    inbox = CommandInbox(RunPaths(cfg).commands_file)
    inbox.install_signal_handlers()
    callbacks = default_callbacks()
    try:
        lock = WorkspaceLock(cfg.general.workspace_dir).acquire()
    except WorkspaceBusy as e:
        log.error("error: %s", e)
        callbacks.on_event("error", text=str(e), rank=0)
        return 2
    try:
        with lock:
            GenericTrainer(cfg, callbacks, inbox, resume, scan=scan).run()
    except Exception as e:
        callbacks.on_event("error", text=f"{type(e).__name__}: {e}", rank=0)
        raise
    return 0
