"""The variables a launch gives its workers before any of Tandem's code runs in them: their GPUs, their
share of the cores, the rendezvous store's settings. No torch here: the spawn launcher computes them
before it has imported PyTorch, to start its workers' forkserver (`forkserver.start_before_imports`)."""
from __future__ import annotations

import contextlib
import os
import platform

from modules.launch.spec import LaunchSpec
from modules.util.cpu_threads import threads_per_worker  # noqa: F401 - the workers' share, also asked for here

CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
SPAWN_VARIABLES = ("CUDA_VISIBLE_DEVICES", "USE_LIBUV", "OMP_NUM_THREADS", CPP_LOG_LEVEL)
"""What the spawn launcher sets only while its workers start (`start_variables`)."""


def on_windows() -> bool:
    return platform.system() == "Windows"


STORE_ENVIRONMENT_WINDOWS = {"USE_LIBUV": "0"}
"""PyTorch >= 2.4 makes the rendezvous store (TCPStore) use libuv unless USE_LIBUV=0, but its Windows
wheels are built without libuv: without this, torchrun and `init_process_group` fail there with
"use_libuv was requested but PyTorch was built without libuv support"."""


def store_environment() -> dict[str, str]:
    """The variables every process that creates or joins the rendezvous store needs on this OS."""
    return dict(STORE_ENVIRONMENT_WINDOWS) if on_windows() else {}


def worker_environment(spec: LaunchSpec) -> dict[str, str]:
    """This process's environment as the workers of `spec` get it."""
    env = dict(os.environ)
    if spec.visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.visible_devices
    # Forced, not defaulted: torchrun's own store and each worker's fail on Windows with USE_LIBUV=1.
    env.update(store_environment())
    # Each worker gets a share of the cores instead of all of them fighting over every core (and
    # torchrun's own default of 1 thread, which starves CPU workers).
    env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(spec.processes_here)))
    # PyTorch's C++ warnings about sockets closing and stores timing out follow from a failure the launcher's
    # headline names; a user who wants them sets the variable.
    env.setdefault(CPP_LOG_LEVEL, "ERROR")
    return env


def start_variables(spec: LaunchSpec | None) -> dict[str, str]:
    """The variables the workers of `spec` need before any of Tandem's code runs (their GPUs, threads, the
    store's settings; none without a spec), set only while they start: the parent keeps seeing every GPU,
    e.g. for a larger next run (`benchmark.py --gpus 1,2,4`)."""
    if spec is None:
        return {}
    env = worker_environment(spec)
    return {k: env[k] for k in SPAWN_VARIABLES if k in env}


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """`values` set in this process's environment (children started meanwhile inherit them), then restored."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, value in before.items():
            if value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = value
