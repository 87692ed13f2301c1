"""How the spawn launcher starts its workers: from a forkserver that imported the libraries once (Linux).

Forked workers would inherit the server's environment, folder and output: each start hands its own over,
and a start under other variables read at import gets a server of its own; the server must never have
initialised CUDA (a forked child of such a process cannot use it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modules.distributed import processes
from modules.distributed.plan import LaunchPlan
from modules.distributed.worker_environment import threads_per_worker
from tests.trainer_helpers import REPO, launch_spec
from tests.patience import patience


# Every test here starts processes (a forkserver importing torch, workers): the slow set.
pytestmark = pytest.mark.slow


def environment_of_server(pid: int) -> dict[str, str]:
    """The environment a forkserver was started with. Read once it runs the server: between the fork and the
    exec /proc shows its parent's start-up environment, without what the launcher set for the server (a busy
    machine's CI read it there)."""
    import time
    deadline = time.monotonic() + patience(60)
    while b"multiprocessing.forkserver" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, f"process {pid} never became the forkserver"
        time.sleep(0.01)
    return dict(line.split("=", 1) for line in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in line)


def report_environment(rank: int, out_dir: str) -> None:
    import multiprocessing

    import torch
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads(),
        "start_method": multiprocessing.get_start_method(), "diffusers_loaded": "diffusers.models.modeling_utils"
        in sys.modules, "parent": os.getppid(), "events": os.environ.get("TANDEM_EVENTS"), "cwd": os.getcwd(),
        "umask": os.umask(0o22)}))
    print(f"rank {rank} reporting", flush=True)


def _start(out_dir: Path, plan, nprocs: int, stop: bool = True) -> list[dict]:
    out_dir.mkdir()
    before = dict(os.environ)
    try:
        processes.start_workers(report_environment, (str(out_dir),), nprocs, plan, join=True)
    finally:
        if stop:
            processes.stop_forkserver()
    assert dict(os.environ) == before  # the parent's own are left as they were
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nprocs)]


@pytest.mark.skipif(sys.platform != "linux", reason="the forkserver is Linux's start method here")
def test_each_start_gives_its_workers_its_own_gpus_threads_environment_folder_umask_and_output(tmp_path, monkeypatch,
                                                                                               capfd):
    """Starts one after another in one process (the benchmark's GPU counts, a test session's launches) keep
    the server, whose imports are what a start costs, and still give each start's workers that start's
    GPUs, threads, variables, working folder, umask and output, as spawned workers would have them. Killed
    meanwhile, the server is started again; a start under other variables read at import (another GPU set,
    thread count) gets a server of its own, whose workers get that start's values - a server kept from an
    earlier start would give them its own. (Three servers for what three tests checked with six.)

    The first server is started as the launcher starts it, right after planning, so that its imports run beside
    the launcher's checks: the workers' start must keep that server (started under the plan's variables), not
    import again. A torchrun plan starts none (its agent starts the workers)."""
    from multiprocessing import forkserver

    from modules.util import launch_clock

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("TANDEM_EVENTS", "first")
    monkeypatch.setattr(launch_clock, "_marks", {})
    processes.stop_forkserver()
    torchrun = LaunchPlan(launch_spec(2, "cuda", "nccl", "torchrun", "0,1"), "127.0.0.1", 29500)
    assert processes.start_forkserver_now(torchrun, report_environment) is False
    assert forkserver._forkserver._forkserver_pid is None and launch_clock.marks() == {}
    two = LaunchPlan(launch_spec(2, "cuda", "nccl", "spawn", "0,1"), "127.0.0.1", 29500)
    try:
        # started during the launcher's checks
        assert processes.start_forkserver_now(two, report_environment) is True
        early = forkserver._forkserver._forkserver_pid
        started = launch_clock.process_start_time(str(early))
        assert abs(started - launch_clock.marks()[launch_clock.FORKSERVER_STARTED]) <= 0.5, "noted for the report"
        assert processes.start_forkserver_now(two, report_environment) is False, "the running one is kept"
        server_environment = environment_of_server(early)
        assert server_environment["CUDA_VISIBLE_DEVICES"] == "0,1", "the plan's GPUs, read at import"
        assert server_environment["OMP_NUM_THREADS"] == str(threads_per_worker(2)), "the plan's threads"
        assert "CUDA_VISIBLE_DEVICES" not in os.environ, "the launcher's own are left as they were"

        first = _start(tmp_path / "first", two, 2, stop=False)
        assert {r["parent"] for r in first} == {early}, "forked from the server started early"
        assert [r["CUDA_VISIBLE_DEVICES"] for r in first] == ["0,1", "0,1"], "the plan's GPUs"
        assert {r["OMP_NUM_THREADS"] for r in first} == {str(threads_per_worker(2))}, "the plan's threads"
        assert {r["threads"] for r in first} == {threads_per_worker(2)}, "torch reads the plan's threads"
        assert {r["start_method"] for r in first} == {"forkserver"}
        assert all(r["diffusers_loaded"] for r in first), "imported by the server, before the fork"
        assert first[0]["parent"] == first[1]["parent"] != os.getpid(), "forked from one server"
        assert {r["events"] for r in first} == {"first"}
        assert "rank 0 reporting" in capfd.readouterr().out, "the workers write where this start's output goes"

        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path / "elsewhere")
        monkeypatch.setenv("TANDEM_EVENTS", "second")
        previous_umask = os.umask(0o077)
        try:
            second = _start(tmp_path / "second", two, 2, stop=False)
        finally:
            os.umask(previous_umask)
        assert {r["parent"] for r in second} == {first[0]["parent"]}, "the same server, not imported again"
        assert {r["events"] for r in second} == {"second"}, "this start's variables"
        assert {r["cwd"] for r in second} == {str(tmp_path / "elsewhere")}, "this start's working folder"
        assert {r["umask"] for r in second} == {0o077}, "this start's umask"
        assert capfd.readouterr().out.count("reporting") == 2, "where this start's output goes"

        os.kill(first[0]["parent"], 9)
        _until_dead(first[0]["parent"])
        third = _start(tmp_path / "third", two, 1, stop=False)
        assert third[0]["parent"] != first[0]["parent"], "a killed server is started again"
        assert third[0]["events"] == "second" and third[0]["CUDA_VISIBLE_DEVICES"] == "0,1"

        capfd.readouterr()
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # read by torch while the server imported it: a new server
        fourth = _start(tmp_path / "fourth", None, 1, stop=False)
        assert fourth[0]["parent"] != third[0]["parent"], "other variables read at import: a server of its own"
        assert fourth[0]["threads"] == 2 and fourth[0]["CUDA_VISIBLE_DEVICES"] is None, "this start's, not the server's"
        assert fourth[0]["events"] == "second"
        assert "rank 0 reporting" in capfd.readouterr().out, "the workers write where this start's output goes"
    finally:
        processes.stop_forkserver()


BEFORE_IMPORTS = """
import json, sys
from multiprocessing import forkserver as server
from modules.config import load_config
from modules.distributed import forkserver

def config(*values):
    return load_config("#demo", ["multi_gpu.enabled=true", *values])

result = {"torchrun": forkserver.start_before_imports(config("general.device=cpu", "multi_gpu.launcher=torchrun")),
          "nvml": forkserver.gpus_visible_without_torch()}
result["cuda"] = forkserver.start_before_imports(config("general.device=cuda"))
result["cpu"] = forkserver.start_before_imports(config("general.device=cpu", "multi_gpu.num_gpus=2"))
result["torch imported"] = "torch" in sys.modules
from tests.integration.test_worker_start import environment_of_server
result["server OMP_NUM_THREADS"] = environment_of_server(server._forkserver._forkserver_pid).get("OMP_NUM_THREADS")
forkserver.stop()
print(json.dumps(result))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the forkserver is Linux's start method here")
def test_the_launcher_starts_the_server_before_it_imports_pytorch(tmp_path):
    """train_multi_gpu.py starts the spawn launcher's server from the config alone (the GPU count from NVML),
    before it imports PyTorch itself: the two import side by side. Torchrun's launches get none, and neither
    do GPU launches where NVML cannot count the GPUs (this machine, unless it has NVIDIA's driver)."""
    from modules.distributed import forkserver

    assert forkserver.LAUNCHER_ENTRY_MODULE == processes._spawn_entry.__module__
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")}
    done = subprocess.run([sys.executable, "-c", BEFORE_IMPORTS], cwd=REPO, capture_output=True, text=True, timeout=patience(120),
                          env={**env, "PYTHONPATH": str(REPO), "TANDEM_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torchrun"] is False
    assert result["cuda"] is bool(result["nvml"]), result
    assert result["cpu"] is True and result["torch imported"] is False, result
    assert result["server OMP_NUM_THREADS"] == str(threads_per_worker(2)), "the workers' share of the cores"


def _until_dead(pid: int, timeout: float = 30) -> None:
    import time
    deadline = time.monotonic() + patience(timeout)
    status = Path(f"/proc/{pid}/status")
    while status.exists() and "\tZ" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_finished_launcher_ends_its_forkserver_at_once(tmp_path):
    """`exit_now` kills the kept server, which holds the launcher's output open: a harness reading that output
    to its end would otherwise wait for the server's own orderly exit (1.3-1.8 s on a GPU host). Gone the
    moment the launcher is, not a while after."""
    script = (
        "from multiprocessing import forkserver\n"
        "from modules.distributed import processes\n"
        "from modules.util.exit import exit_now\n"
        "from tests.integration.test_worker_start import report_environment\n"
        f"processes.start_workers(report_environment, ({str(tmp_path)!r},), 1, None, join=True)\n"
        "print('server', forkserver._forkserver._forkserver_pid, flush=True)\n"
        "exit_now(0)\n")
    with open(tmp_path / "out.txt", "w") as out:
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                              timeout=patience(300))
    status = None
    server = int((tmp_path / "out.txt").read_text().split("server ")[1].split()[0])
    try:
        status = Path(f"/proc/{server}/status").read_text()
    except OSError:
        pass
    assert done.returncode == 0, (tmp_path / "out.txt").read_text()[-3000:]
    assert status is None or "\tZ" in status, f"the forkserver {server} outlived its launcher:\n{status}"
    assert (tmp_path / "rank0.json").exists()


PROBE = """
import torch, traceback
asked = []
def record(name):
    def call(*args, **kwargs):
        asked.append(name + ''.join(traceback.format_stack(limit=8)[:-1]))
        raise AssertionError(name + ' called while importing')
    return call
for name in ('is_available', 'device_count', 'init', '_lazy_init', 'current_device', 'get_device_properties',
             'get_device_capability', 'is_bf16_supported', 'mem_get_info'):
    setattr(torch.cuda, name, record(name))
from modules.distributed.forkserver import PRELOADED
import importlib
for module in PRELOADED:
    importlib.import_module(module)
print(len(asked))
for a in asked:
    print(a)
"""


def test_what_the_forkserver_imports_never_asks_cuda_anything():
    """A process that initialised CUDA cannot fork workers that use it: nothing the server preloads may ask
    about the GPUs at import (a CPU build cannot initialise CUDA, so every question is recorded instead)."""
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=patience(300))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == "0", done.stdout[-3000:]
