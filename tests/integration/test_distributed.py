"""Multi-process training on CPU over gloo, through the real launch paths (spawn and torchrun).

The central property: N processes x batch B train exactly what 1 process x batch N*B trains.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modules.distributed.launch import LaunchError, launch, plan_launch
from modules.util.run_protocol import parse_event_line
from tests.trainer_helpers import (REPO, assert_weights_close, demo_config, files_under, latest_backup_weights,
                                   launch_spec, launcher_flag, multi, overrides_for, relative_l2, run_script,
                                   start_script)
from tests.patience import patience

STEPS = 3


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def single(workspace, cache, *overrides, method="lora", resume=None):
    from modules.trainer.generic_trainer import GenericTrainer
    cfg = demo_config(workspace, cache, *overrides, method=method)
    GenericTrainer(cfg, resume=resume).run()


@pytest.mark.parametrize("method,accumulation,checkpointing,split_caching", [("lora", 2, False, True),
                                                                              ("full", 1, True, False)],
                         ids=["lora-accumulation-split_caching", "full-checkpointing-rank0_caching"])
@pytest.mark.slow
def test_two_processes_equal_one_with_double_batch(tmp_path, tandem_home, method, accumulation, checkpointing,
                                                   split_caching):
    """2 x batch 4 == 1 x batch 8 after a few steps (fp32), with gradient accumulation and checkpointing, each
    run building its own cache: split caching (distributed data loading, the default: each rank caches its
    share) fills the whole cache bitwise as one process does; rank-0 caching (distributed data loading off)
    fills it whole too.

    One launch per case serves what were separate tests (CI time). LoRA without accumulation and a full
    fine-tune without checkpointing take the same DDP paths as these two cases, and are held to 1 process
    elsewhere: test_two_processes_equal_one_with_masks_regularisation_and_validation and
    test_the_stop_command_stops_every_rank_at_one_step_and_one_process_continues_the_backup (LoRA,
    accumulation 1),
    tests/integration/test_family_training.py's full cases (a full fine-tune without checkpointing)."""
    common = (f"training.max_steps={STEPS}", f"save.backup_every_n_steps={STEPS}",
              f"training.gradient_checkpointing={str(checkpointing).lower()}",
              f"training.gradient_accumulation_steps={accumulation}", "training.precision=fp32",
              # Adam turns gradients that are pure rounding noise (e.g. biases before a GroupNorm) into
              # full-size steps, so summation order alone would move those weights by ~lr. SGD keeps the
              # comparison tight; the optimizer is the same code either way.
              "optimizer.name=sgd", "training.learning_rate=0.05",
              # every demo caption cached as it is (the whole-cache count below)
              "data.caption_dropout=0")
    cache_one, cache_two = tmp_path / "cache-one", tmp_path / "cache-two"
    single(tmp_path / "one", cache_one, *common, "training.batch_size=8", method=method)
    multi(tmp_path / "two", cache_two, *common, "training.batch_size=4",
          f"multi_gpu.distributed_data_loading={str(split_caching).lower()}", method=method)

    # The cache the 2 processes built: whole, and (split caching) bitwise the one process's. Latents were
    # sampled in encode order, so 2 processes cached other values than 1 (9 of 10 entries); now an entry
    # holds the VAE's distribution, encoded in batches cut from the data.
    _assert_the_whole_demo_is_cached(cache_two)
    names = files_under(cache_one)
    assert names == files_under(cache_two), "1 and 2 processes cached other entries"
    assert len([n for n in names if n.startswith("latents/")]) == 64 and any(n.startswith("text/") for n in names)
    if split_caching:
        different = [n for n in names if (cache_one / n).read_bytes() != (cache_two / n).read_bytes()]
        assert not different, f"split caching: {len(different)} of {len(names)} entries differ, e.g. {different[:3]}"

    one, two = latest_backup_weights(tmp_path / "one"), latest_backup_weights(tmp_path / "two")
    if method == "lora":
        # Guards the comparison: after STEPS steps the LoRA up-weights are no longer zero.
        ups = [v for k, v in one.items() if "lora_B" in k or "lora_up" in k]
        assert ups and all(v.abs().max() > 0 for v in ups), "the LoRA up-weights did not train"
    assert_weights_close(two, one, atol=2e-5, rtol=1e-4)
    # Each run with its own cache: the same weights (caches that differ would move them far more).
    error = relative_l2(two, one)
    assert error <= 1e-6, f"relative L2 {error:.2e} between 2 processes and 1, each with its own cache"
    # Only rank 0 writes: the run folders of 1 and 2 processes hold exactly the same files.
    # backups/ and config/ hold the same files, named by the run id (a start time); .tandem/ holds the
    # launcher's own files (workspace lock, commands), which a trainer started directly has no use for.
    skip = ("backups/", "config/", ".tandem/")
    assert files_under(tmp_path / "two", skip) == files_under(tmp_path / "one", skip)
    for run in ("one", "two"):
        (run_dir,) = (tmp_path / run / "backups").iterdir()
        # the one backup, and the marker of a finished run (which Continue does not offer)
        assert sorted(p.name for p in run_dir.iterdir()) == ["finished.json", f"step-{STEPS:08d}"]
        assert [p.name for p in (tmp_path / run / "config").iterdir()] == [f"{run_dir.name}.json"]


@pytest.mark.parametrize("ended", [True, False])
def test_teardown_runs_a_full_collection_only_where_the_interpreter_may_still_free_the_group(ended, monkeypatch):
    """After a cold torch.compile a full garbage collection keeps a finished multi-GPU run alive seconds after
    `done`. A run that ended leaves through exit_now and needs none; a failed one still frees DDP's group before
    the interpreter's exit can (pytorch/pytorch#179291)."""
    from modules.distributed import distributed_trainer
    collections, destroyed = [], []
    monkeypatch.setattr(distributed_trainer.gc, "collect", lambda *args: collections.append(args) or 0)
    monkeypatch.setattr(distributed_trainer, "destroy", lambda: destroyed.append(True))
    trainer = object.__new__(distributed_trainer.DistributedTrainer)
    trainer.ended, trainer.model = ended, object()
    trainer.teardown()
    assert trainer.model is None and destroyed == [True]
    assert len(collections) == (0 if ended else 1)


def _events(stdout: str) -> list[dict]:
    return [e for e in map(parse_event_line, stdout.splitlines()) if e]


@pytest.mark.slow
def test_the_stop_command_stops_every_rank_at_one_step_and_one_process_continues_the_backup(
        tmp_path, cache_dir, capfd, monkeypatch):
    """`stop` in the commands file (read by rank 0 only): all ranks stop together and one backup is written;
    rank 0 reports every rank's own loss and images/s (the GUI's per-GPU view). That backup of 2 processes x 4,
    continued on 1 process x 8, trains what 1 x 8 trains uninterrupted (resume with another world size).

    Launched in this process (the spawn launcher, as the GUI's runs); the stop command is launcher-agnostic.
    What is torchrun's own - train_multi_gpu.py --torchrun goes through torchrun and trains, stops on Ctrl-C,
    ends when a worker dies - is test_ctrl_c_stops_cleanly_with_a_backup[torchrun]'s and
    test_killed_worker_ends_the_whole_job[torchrun]'s; that a torchrun run finishes and writes its model is
    test_users_own_torchrun_command's."""
    import threading

    from modules.distributed.job import job_path

    exact = ("training.precision=fp32", "optimizer.name=sgd", "training.learning_rate=0.05")
    two = demo_config(tmp_path / "two", cache_dir, *exact, "training.max_steps=500", "training.batch_size=4",
                      "save.backup_every_n_steps=1000", "multi_gpu.enabled=true", "multi_gpu.num_gpus=2",
                      "multi_gpu.launcher=spawn")
    commands, job = tmp_path / "two" / ".tandem" / "commands", job_path(two, 0)
    gave_up = time.monotonic() + patience(300)

    def stop_once_launched():
        # The launcher writes the job file after it took the commands file's end: a stop from then on is this
        # run's, also one written before rank 0's first look (it then acts on an early step).
        while not job.exists() and time.monotonic() < gave_up:
            time.sleep(0.05)
        with open(commands, "a") as f:
            f.write("stop\n")

    stopper = threading.Thread(target=stop_once_launched, daemon=True)
    monkeypatch.setenv("TANDEM_EVENTS", "1")
    capfd.readouterr()
    stopper.start()
    try:
        assert launch(two) == 0
    finally:
        stopper.join(timeout=patience(300))
    events = _events(capfd.readouterr().out)
    config = next(e for e in events if e["type"] == "config")
    assert config["world_size"] == 2 and config["global_batch"] == 8
    losses = [e for e in events if e["type"] == "loss"]
    assert losses and all(len(e["rank_losses"]) == 2 for e in losses), "a loss without each rank's own"
    assert all(e["loss"] == pytest.approx(sum(e["rank_losses"]) / 2) for e in losses)
    assert losses[0]["rank_losses"][0] != losses[0]["rank_losses"][1], "the ranks trained on the same data"
    last = [e for e in events if e["type"] == "progress"][-1]
    assert len(last["rank_images_per_s"]) == 2 and all(rate > 0 for rate in last["rank_images_per_s"])
    done = [e for e in events if e["type"] == "done"]
    assert len(done) == 1, "exactly one rank reports"
    stopped_at = done[0]["step"]
    assert not done[0]["completed"] and stopped_at < 20, "the stop command did not stop the run"
    backups_written = [e for e in events if e["type"] == "backup"]
    assert len(backups_written) == 1 and backups_written[0]["step"] == stopped_at, \
        "the ranks did not stop at one step with one backup"

    until = (f"training.max_steps={stopped_at + 1}", f"save.backup_every_n_steps={stopped_at + 1}")
    single(tmp_path / "one", cache_dir, *exact, *until, "training.batch_size=8")
    single(tmp_path / "two", cache_dir, *exact, *until, "training.batch_size=8", resume="latest")
    assert_weights_close(latest_backup_weights(tmp_path / "two"), latest_backup_weights(tmp_path / "one"),
                         atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_users_own_torchrun_command(tmp_path, cache_dir):
    """`torchrun --nproc_per_node=2 scripts/train.py --config-path X` works as documented and finishes the demo."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           str(REPO / "scripts" / "train.py"), "--config-path", "#demo", "--device", "cpu",
           *overrides_for(tmp_path / "ws", cache_dir, "training.max_steps=2")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=patience(600), cwd=REPO,
                            env=dict(os.environ, TANDEM_EVENTS="1", OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    events = _events(result.stdout)
    config = next(e for e in events if e["type"] == "config")
    assert config["world_size"] == 2
    done = [e for e in events if e["type"] == "done"]
    assert len(done) == 1 and done[0]["completed"], "exactly one rank reports a finished run"
    assert Path(done[0]["output"]).is_file(), "the finished run wrote no model"
    assert [len(e["rank_losses"]) for e in events if e["type"] == "loss"] == [2, 2]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_killed_worker_ends_the_whole_job(tmp_path, cache_dir, launcher):
    """SIGKILL on rank 1: the job exits non-zero within the timeout and names the failure; no orphans."""
    ws = tmp_path / "ws"
    args = ["--config-path", "#demo", "--device", "cpu", "--num-gpus", "2",
            *overrides_for(ws, cache_dir, "training.max_steps=100000", "multi_gpu.timeout_minutes=1")]
    args += launcher_flag(launcher)
    proc = start_script("train_multi_gpu.py", *args, start_new_session=True)
    try:
        lines = read_until_step(proc, 2)
        victim = _worker_pids(proc.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=patience(120))
        took = time.monotonic() - started
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    output = "".join(lines)
    assert code != 0
    assert took < patience(90), f"job took {took:.0f}s to exit after a worker died"
    assert ("rank" in output.lower()) and ("exit" in output.lower() or "signal" in output.lower()), output[-2000:]
    assert not _worker_pids(proc.pid), "worker processes left behind"


def read_until_step(proc: subprocess.Popen, step: int) -> list[str]:
    """Output lines of a running training up to (and with) the progress event of `step`."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        event = parse_event_line(line)
        if event and event["type"] == "progress" and event["step"] == step:
            return lines
    raise AssertionError(f"training ended before step {step}:\n" + "".join(lines)[-3000:])


def _worker_pids(parent: int) -> list[int]:
    """Python descendants of `parent` that run training workers."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    children: dict[int, list[int]] = {}
    args = {}
    for row in out:
        pid, ppid, *cmd = row.split(None, 2)
        children.setdefault(int(ppid), []).append(int(pid))
        args[int(pid)] = cmd[0] if cmd else ""
    found, stack = [], [parent]
    while stack:
        for child in children.get(stack.pop(), []):
            stack.append(child)
            agent = "torch.distributed.run" in args[child] or "modules.distributed.agent" in args[child]
            # torchrun's agent is no worker, nor is the spawn launcher's forkserver (the launcher's child that
            # the workers are forked from: they show its command line)
            server = "multiprocessing.forkserver" in args[child] and child in children.get(parent, [])
            if "python" in args.get(child, "") and not agent and not server:
                found.append(child)
    # spawn also starts a resource tracker; workers are the processes that run the training.
    return sorted(p for p in found if "resource_tracker" not in args[p] and "semaphore_tracker" not in args[p])


def test_a_users_torchrun_trains_in_the_world_it_made(monkeypatch, caplog):
    """multi_gpu.enabled decides what Tandem's own starts run; workers someone else's torchrun started
    train together whatever it says, and the log says so."""
    import logging

    import torch

    from modules.config import TrainConfig
    from modules.distributed import worker as launch_module
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(launch_module.log, "propagate", True)
    with caplog.at_level(logging.INFO, logger="tandem"):
        job = launch_module.external_worker_job(TrainConfig(), "latest")
    assert (job.spec.launcher, job.spec.world_size, job.spec.device_type, job.resume) == ("external", 3, "cpu", "latest")
    assert "multi_gpu.enabled is off, but torchrun started 3 workers" in caplog.text


def test_validation_before_any_worker_starts(tmp_path, cache_dir):
    cfg = demo_config(tmp_path / "ws", cache_dir, "multi_gpu.enabled=true", "multi_gpu.backend=nccl")
    with pytest.raises(LaunchError, match="nccl"):
        plan_launch(cfg)
    cfg = demo_config(tmp_path / "ws", cache_dir, "multi_gpu.enabled=true", "general.device=cuda")
    with pytest.raises(LaunchError, match="CUDA|GPU"):
        plan_launch(cfg)
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = demo_config(tmp_path / "ws", cache_dir, "multi_gpu.enabled=true", f"multi_gpu.master_port={port}")
        with pytest.raises(LaunchError, match=f"{port} is in use"):
            plan_launch(cfg)
    cfg = demo_config(tmp_path / "ws", cache_dir, "multi_gpu.enabled=true", "multi_gpu.num_gpus=3",
                      "training.batch_size=32")
    with pytest.raises(LaunchError, match="give no full batches of 96"):
        launch(cfg)
    assert not (tmp_path / "ws" / "backups").exists()


def test_lr_scaling_is_reported(tmp_path, cache_dir):
    from modules.trainer.run_numbers import derive_run_numbers
    cfg = demo_config(tmp_path / "ws", cache_dir, "multi_gpu.lr_scaling=linear", "training.learning_rate=0.0001")
    numbers = derive_run_numbers(cfg, world_size=4, micro_batches_per_epoch=10)
    assert numbers.lr == pytest.approx(4e-4) and numbers.global_batch == 32
    cfg = demo_config(tmp_path / "ws", cache_dir, "multi_gpu.lr_scaling=sqrt", "training.learning_rate=0.0001")
    assert derive_run_numbers(cfg, 4, 10).lr == pytest.approx(2e-4)
    assert "global batch 32" in numbers.describe() and "linear" in numbers.describe()


@pytest.mark.slow
def test_equivalence_checker_script(tmp_path, cache_dir):
    """scripts/check_equivalence.py (used on GPU machines for any N) passes at N=2 on CPU processes."""
    import json
    result = run_script("check_equivalence.py", "--device", "cpu", "--num-gpus", "2", "--batch", "4", "--steps", "2",
                        "--launchers", "spawn", "--tolerance", "1e-5", "--config-value", "training.method=lora",
                        "--config-value", "training.precision=fp32", "--config-value", "training.learning_rate=0.05")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = [json.loads(x) for x in result.stdout.splitlines() if x.startswith('{"check"')]
    assert line["ok"] and line["world_size_seen"] == 2 and line["relative_l2"] < 1e-5 and line["tensors"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_ctrl_c_stops_cleanly_with_a_backup(tmp_path, cache_dir, launcher):
    """Ctrl-C (SIGINT to the terminal's process group): every rank stops at one step, backs up, exit 0. The
    torchrun case is also the test that train_multi_gpu.py --torchrun goes through torchrun and trains."""
    ws = tmp_path / "ws"
    args = ["--config-path", "#demo", "--device", "cpu", "--num-gpus", "2",
            *overrides_for(ws, cache_dir, "training.max_steps=100000")]
    # --torchrun: the flag's spelling of --launcher torchrun (which test_killed_worker_ends_the_whole_job uses)
    flag = ["--torchrun"] if launcher == "torchrun" else launcher_flag(launcher)
    proc = start_script("train_multi_gpu.py", *args, *flag, start_new_session=True)
    try:
        lines = read_until_step(proc, 2)
        os.killpg(proc.pid, signal.SIGINT)
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=patience(120))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    output = "".join(lines)
    events = _events(output)
    assert code == 0, output[-3000:]
    if launcher == "torchrun":
        assert "torch.distributed.run" in output, "the run did not go through torchrun"
    done = next(e for e in events if e["type"] == "done")
    backup = [e for e in events if e["type"] == "backup"]
    assert not done["completed"] and len(backup) == 1 and backup[0]["step"] == done["step"]
    assert not _worker_pids(proc.pid)


def _assert_the_whole_demo_is_cached(cache: Path) -> None:
    assert len(list((cache / "latents").glob("*.safetensors"))) == 64  # one entry per demo image
    assert len(list((cache / "text").glob("*.safetensors"))) == 64


def test_workers_share_the_cores(monkeypatch):
    """Each of N workers gets cores / N threads (GPU workers too), unless OMP_NUM_THREADS says otherwise."""
    import torch

    from modules.distributed.plan import LaunchPlan
    from modules.distributed.processes import _worker_env
    from modules.distributed.process_group import share_cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    plan = LaunchPlan(launch_spec(4, "cuda", "nccl", "torchrun", None), "127.0.0.1", 29500)
    assert _worker_env(plan)["OMP_NUM_THREADS"] == "4"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _worker_env(plan)["OMP_NUM_THREADS"] == "3"

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        share_cpu_threads(2)  # OMP_NUM_THREADS is set: left alone
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        share_cpu_threads(8)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


def test_each_gpu_worker_sees_only_its_own_gpu_before_cuda_starts(monkeypatch):
    """Every rank trains on `cuda:0` of its own view, so torch.compile's cache (whose keys name the GPU)
    serves every rank and world size alike; messages still number the GPU as the launch saw it."""
    import torch

    from modules.distributed.process_group import see_only_own_gpu
    from modules.util.dist_utils import GPU_NUMBER, gpu_number

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv(GPU_NUMBER, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")  # the user's choice, or the launcher's device_indexes
    assert see_only_own_gpu(1) and os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert gpu_number(torch.device("cuda", 0)) == 1

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # nothing chosen: all of the machine's GPUs
    assert see_only_own_gpu(2) and os.environ["CUDA_VISIBLE_DEVICES"] == "2" and os.environ[GPU_NUMBER] == "2"

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a1,GPU-b2")
    assert not see_only_own_gpu(2) and os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-a1,GPU-b2"  # no such GPU
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late: CUDA read the variable
    assert not see_only_own_gpu(0) and os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-a1,GPU-b2"

    monkeypatch.delenv(GPU_NUMBER)
    assert gpu_number(torch.device("cuda", 3)) == 3


@pytest.mark.slow
def test_a_worker_all_reduces_only_after_the_last_micro_batch_and_frees_ddp_before_exit(tmp_path, cache_dir,
                                                                                        monkeypatch):
    """One rank of the real DistributedTrainer, in this process, with 2 micro-batches a step:

    - every micro-batch but the last runs inside DDP's no_sync: its backward all-reduces nothing, and the last
      one's does (counted by a comm hook on the real DDP wrapper; that the synchronised sum then trains what
      1 process trains is test_two_processes_equal_one_with_double_batch's accumulation case);
    - the trainer's reference cycles (frozen from collection during the run) kept the DDP wrapper, and with it
      gloo's process group, alive until interpreter exit, where freeing them aborted finished workers now and
      then. A finished worker must have freed both itself."""
    import contextlib
    import gc
    import socket
    import weakref

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from modules.distributed.ddp import DDPParallelism
    from modules.distributed.distributed_trainer import DistributedTrainer
    from modules.trainer.callbacks import RecordingCallbacks

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), OMP_NUM_THREADS="1").items():
        monkeypatch.setenv(k, v)
    cfg = demo_config(tmp_path, cache_dir, "training.max_steps=2", "training.batch_size=2",
                      "training.gradient_accumulation_steps=2", "multi_gpu.enabled=true", "multi_gpu.backend=gloo")
    trainer = DistributedTrainer(cfg, RecordingCallbacks(), device_type="cpu")
    all_reduces, backwards, wrappers = [], [], []

    def counted_all_reduce(state, bucket):
        all_reduces.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    def wrap_and_count(model, wrap=trainer.wrap_model):
        wrappers.append(wrap(model))
        wrappers[-1].register_comm_hook(None, counted_all_reduce)
        return wrappers[-1]

    @contextlib.contextmanager
    def noted_sync(parallel, model, last_micro_batch, sync=DDPParallelism.gradient_sync):
        before = len(all_reduces)
        with sync(parallel, model, last_micro_batch):
            yield
        backwards.append((last_micro_batch, len(all_reduces) - before))

    monkeypatch.setattr(trainer, "wrap_model", wrap_and_count)
    monkeypatch.setattr(DDPParallelism, "gradient_sync", noted_sync)  # the step's micro-batch schedule asks it
    threads = torch.get_num_threads()
    try:
        trainer.run()
    finally:
        torch.set_num_threads(threads)
    assert trainer.completed and isinstance(wrappers[0], torch.nn.parallel.DistributedDataParallel)
    assert [last for last, _ in backwards] == [False, True, False, True]
    assert all(count == 0 for last, count in backwards if not last), f"all-reduced inside no_sync: {backwards}"
    assert all(count > 0 for last, count in backwards if last), f"the last micro-batch did not all-reduce: {backwards}"
    ddp = weakref.ref(wrappers.pop())
    assert ddp() is None, "the DDP wrapper outlived the run"
    assert not dist.is_initialized()
    assert gc.get_freeze_count() == 0


@pytest.mark.slow
def test_two_processes_equal_one_with_masks_regularisation_and_validation(tmp_path, cache_dir, capfd, monkeypatch):
    """2 x batch 4 == 1 x batch 8 with a masked concept, a regularisation concept (its own repeats and loss
    weight) and a validation concept: the same weights, and the same validation loss at every evaluation."""
    import torch

    from modules.distributed.process_group import share_cpu_threads
    from modules.trainer.callbacks import RecordingCallbacks
    from tests.unit.test_masks import make_masked_demo
    from tests.trainer_helpers import train
    from tests.unit.test_validation_loss import validation_folder
    masked = make_masked_demo(tmp_path / "masked", count=16)
    regularisation = tmp_path / "regularisation"
    regularisation.mkdir()
    for path in sorted(masked.glob("*.png"))[:6]:
        if not path.stem.endswith("-masklabel"):
            shutil.copy(path, regularisation / path.name)
    held_out = validation_folder(tmp_path, count=5)
    common = (f"training.max_steps={STEPS}", f"save.backup_every_n_steps={STEPS}", "training.precision=fp32",
              "optimizer.name=sgd", "training.learning_rate=0.05", "training.validation_every_n_steps=1",
              "data.caption_dropout=0",
              f"data.concepts[0].path={masked}", "data.concepts[0].masks=true", "data.concepts[0].unmasked_weight=0.1",
              f"data.concepts[1].path={regularisation}", "data.concepts[1].role=regularisation",
              "data.concepts[1].repeats=2", "data.concepts[1].loss_weight=0.5",
              f"data.concepts[2].path={held_out}", "data.concepts[2].role=validation")
    callbacks = RecordingCallbacks()
    threads = torch.get_num_threads()
    # Each of the 2 workers gets its share of the cores (process_group.share_cpu_threads); CPU kernels round
    # by their thread count, so the single process runs with as many threads as one worker.
    share_cpu_threads(2)
    try:
        train(demo_config(tmp_path / "one", cache_dir, *common, "training.batch_size=8"), callbacks)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("TANDEM_EVENTS", "1")
    capfd.readouterr()
    multi(tmp_path / "two", cache_dir, *common, "training.batch_size=4")
    two_events = [e for e in _events(capfd.readouterr().out) if e["type"] == "validation"]
    one_events = callbacks.of_type("validation")
    assert [e["step"] for e in one_events] == [e["step"] for e in two_events] == list(range(STEPS + 1))
    assert all(e["images"] == 5 for e in one_events + two_events)
    assert two_events[0]["loss"] == one_events[0]["loss"], "the same weights score the same on 1 and 2 processes"
    for one, two in zip(one_events, two_events):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-6, abs=0)
    assert_weights_close(latest_backup_weights(tmp_path / "two"), latest_backup_weights(tmp_path / "one"),
                         atol=2e-5, rtol=1e-4)
