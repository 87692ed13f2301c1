"""Ending a finished process quickly."""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


_started_by: int | None = None
"""This process's parent when `die_with_parent` was asked for (POSIX): `parent_gone` compares with it."""
_must_outlive: set[int] = set()
"""The processes named to `die_with_parent` that this one must not outlive (`orphaned`)."""


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have the system kill this process (SIGKILL) when the process that started it ends (Linux; elsewhere only
    noted, for `parent_gone`). `parent_pid`: the process that must still be there - the parent, or the one that
    asked for this process (it may have ended before this was asked for)."""
    global _started_by
    if os.name == "posix":
        _started_by = os.getppid()
    if parent_pid is not None:
        _must_outlive.add(parent_pid)
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        return
    if parent_pid is not None and os.getppid() != parent_pid and not pid_exists(parent_pid):
        os._exit(1)


def parent_gone() -> bool:
    """Whether the parent this process had when `die_with_parent` was asked for has ended (POSIX: the process
    was handed to another parent). False where nothing was noted, and on Windows, whose parent pid never
    changes. Where the parent-death signal exists this is a second look only; elsewhere (macOS) the only one."""
    return _started_by is not None and os.getppid() != _started_by


def orphaned() -> bool:
    """Whether a process this one must die with has ended (or is a zombie), though the system may not have
    killed this one yet: the parent-death signal travels down a chain (the launcher, its forkserver, the
    worker) and a busy machine took 70 ms for it, time enough for a backup to be published by a worker whose
    launcher was gone. Checked right before something is made visible to a later run."""
    return parent_gone() or any(not process_running(pid) for pid in _must_outlive)


def process_running(pid: int) -> bool:
    """Whether `pid` exists and has not ended: a zombie (ended, not yet reaped) counts as ended (Linux reads its
    state; elsewhere any existing process counts as running)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (name) S ...": the state follows the last ')' (a name may hold parentheses).
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return not os.path.isdir("/proc/self") and pid_exists(pid)
    except (OSError, IndexError):
        return pid_exists(pid)


def pid_exists(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie too; one of another user too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_now(code: int) -> NoReturn:
    """Leave the process with `code` at once, skipping the interpreter's clean-up.

    By the time a run returns, everything it wrote is complete and closed (model, backups, TensorBoard,
    event lines) and its loader workers and process group are gone. What the interpreter would still do
    is free a model's worth of objects, CUDA's memory pools and library threads one by one, which kept
    finished runs alive for 10-20 s on GPUs; the operating system frees all of it at once.
    """
    stop_multiprocessing_forkserver()
    multiprocessing_util = sys.modules.get("multiprocessing.util")
    if multiprocessing_util is not None:
        # Its finalizers release the named semaphores of this process's locks and queues (tqdm's lock, made
        # by diffusers' sampling progress bar); skipped, a spawn launcher's resource tracker warned at the
        # end of every run about "leaked semaphore objects" it then had to clean up itself.
        _leave_compile_workers_to_end_themselves(multiprocessing_util)
        multiprocessing_util._run_finalizers()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave_compile_workers_to_end_themselves(multiprocessing_util) -> None:
    """Drop the finalizers that would shut torch.compile's worker pools down and wait for them.

    Each pool is a helper process that ends its workers by itself when this process's end closes the pipe
    it reads; waiting for that here kept compiled runs alive 1 s after `done` with 8 workers on 2 cores.
    (On H100 hosts the 3.7-4.0 s after cold compiles were the trainer's garbage collection instead, see
    DistributedTrainer.teardown.)"""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    pools = getattr(async_compile, "_pool_set", None)
    if not pools:
        return
    for finalizer in list(getattr(multiprocessing_util, "_finalizer_registry", {}).values()):
        if getattr(getattr(finalizer, "_callback", None), "__self__", None) in pools:
            finalizer.cancel()


def stop_multiprocessing_forkserver() -> None:
    """End this process's multiprocessing forkserver, if it started one (the spawn launcher's, whose workers
    have ended).

    Killed, not asked to leave: it holds nothing, and its interpreter's orderly exit after all those imports
    kept a finished run waiting 1.3-1.8 s more on a GPU host (2x H200, `done` to exit): it holds the
    launcher's output open until it has exited."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    import signal
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server._stop()  # closes its pipe, reaps it, removes its socket
