"""How the spawn launcher starts its workers: from a forkserver that imported the libraries once (Linux).

Forked workers inherit the server's environment and output, so each start gets a server of its own; the
server must never have initialised CUDA (a forked child of such a process cannot use it).
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
from modules.distributed.process_group import threads_per_worker
from tests.trainer_helpers import REPO, launch_spec


def report_environment(rank: int, out_dir: str) -> None:
    import multiprocessing

    import torch
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads(),
        "start_method": multiprocessing.get_start_method(), "diffusers_loaded": "diffusers.models.modeling_utils"
        in sys.modules, "parent": os.getppid(), "events": os.environ.get("TANDEM_EVENTS")}))
    print(f"rank {rank} reporting", flush=True)


def _start(out_dir: Path, plan, nprocs: int) -> list[dict]:
    out_dir.mkdir()
    before = dict(os.environ)
    try:
        processes.start_workers(report_environment, (str(out_dir),), nprocs, plan, join=True)
    finally:
        processes.stop_forkserver()
    assert dict(os.environ) == before  # the parent's own are left as they were
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nprocs)]


@pytest.mark.skipif(sys.platform != "linux", reason="the forkserver is Linux's start method here")
def test_each_start_gives_its_workers_its_own_gpus_threads_and_output(tmp_path, monkeypatch, capfd):
    """Two starts from one process (the benchmark's GPU counts one after another): each start's workers get
    that start's variables and output - a forkserver kept from the first start would give them its own."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    two = LaunchPlan(launch_spec(2, "cuda", "nccl", "spawn", "0,1"), "127.0.0.1", 29500)
    first = _start(tmp_path / "first", two, 2)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in first] == ["0,1", "0,1"]
    assert {r["OMP_NUM_THREADS"] for r in first} == {str(threads_per_worker(2))}
    assert {r["threads"] for r in first} == {threads_per_worker(2)}
    assert {r["start_method"] for r in first} == {"forkserver"}
    assert all(r["diffusers_loaded"] for r in first)  # imported by the server, before the fork
    assert first[0]["parent"] == first[1]["parent"] != os.getpid()  # forked from one server
    capfd.readouterr()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("TANDEM_EVENTS", "1")
    second = _start(tmp_path / "second", None, 1)
    assert second[0]["CUDA_VISIBLE_DEVICES"] is None and second[0]["threads"] == 2 and second[0]["events"] == "1"
    assert second[0]["parent"] != first[0]["parent"]
    assert "rank 0 reporting" in capfd.readouterr().out  # the workers write where this start's output goes


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
from modules.distributed.processes import PRELOADED
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
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == "0", done.stdout[-3000:]
