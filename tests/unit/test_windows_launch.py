"""Windows multi-GPU: gloo, USE_LIBUV=0 for every rendezvous store, and start-multi-gpu.bat's logic.

Windows itself is not available here, so `platform.system()` is made to answer "Windows" and the
environment each launch path builds is checked; the batch file only installs and hands its arguments
to scripts/start_multi_gpu.py, which runs here on the same answers as start-multi-gpu.sh.
"""
from __future__ import annotations

import io
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from modules import start_multi_gpu
from modules.distributed import job as jobs, process_group, processes
from modules.distributed.plan import LaunchPlan
from modules.distributed.processes import _worker_env, start_variables
from tests.launcher_helpers import BAT, PY, REPO, launcher_env, printed_command, run_sh
from modules.util.ports import find_free_port
from tests.trainer_helpers import launch_spec
from tests.patience import patience


@pytest.fixture
def windows(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Windows")


PLAN = LaunchPlan(launch_spec(2, "cuda", "gloo", "torchrun", "0,1"), "127.0.0.1", 29500)


def test_worker_environment_turns_libuv_off_on_windows_only(monkeypatch):
    monkeypatch.setenv("USE_LIBUV", "1")  # a user's setting that would break the Windows store
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    assert _worker_env(PLAN)["USE_LIBUV"] == "1"
    monkeypatch.setattr(platform, "system", lambda: "Windows")
    env = _worker_env(PLAN)
    assert env["USE_LIBUV"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_spawned_workers_get_use_libuv_0_and_the_parent_keeps_its_own(windows, monkeypatch):
    monkeypatch.delenv("USE_LIBUV", raising=False)
    assert processes.start_method() == "spawn"
    assert start_variables(PLAN)["USE_LIBUV"] == "0"
    assert "USE_LIBUV" not in os.environ


def test_torchrun_gets_use_libuv_0_for_its_own_store(windows, monkeypatch, tmp_path):
    """torchrun creates the rendezvous store in its own process: the variable must be in its environment."""
    started = {}

    class FakeTorchrun:
        pid = 1

        def __init__(self, cmd, env, **kwargs):
            started.update(cmd=cmd, env=env)

        def wait(self):
            return 0

    monkeypatch.setattr(processes.subprocess, "Popen", FakeTorchrun)
    monkeypatch.setattr(processes, "_own_process_group", lambda: {})
    from modules.distributed.supervision import StopSignals
    from tests.trainer_helpers import demo_config
    cfg = demo_config(tmp_path / "ws", tmp_path / "cache")
    job_file = jobs.write_job(jobs.WorkerJob(cfg, PLAN.spec))
    assert processes.launch_torchrun(job_file, PLAN, "127.0.0.1:29500", StopSignals(tmp_path / "commands")) == (0, [])
    # torch.distributed.run, through the wrapper that notes how failed workers ended (modules/distributed/agent.py)
    assert started["cmd"][1:3] == ["-m", "modules.distributed.agent"] and started["env"]["USE_LIBUV"] == "0"
    # The workers get one file, the job: no option repeats a config value.
    assert started["cmd"][-2:] == ["--launch-file", str(job_file)]
    job = jobs.read_job(job_file)
    assert job.spec == PLAN.spec and job.resume is None and job.cfg == cfg


def test_backend_is_gloo_on_windows_and_nccl_is_refused(windows):
    assert process_group.resolve_backend("auto", "cuda") == "gloo"
    assert process_group.resolve_backend("gloo", "cuda") == "gloo"
    with pytest.raises(RuntimeError, match="Windows builds have no NCCL: use 'gloo' or 'auto'"):
        process_group.resolve_backend("nccl", "cuda")


def test_a_worker_joins_with_a_libuv_free_store_on_windows(windows, monkeypatch):
    """Also a worker that no Tandem launcher started (the user's own torchrun): init_worker sets the variable."""
    monkeypatch.delenv("USE_LIBUV", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    monkeypatch.setenv("OMP_NUM_THREADS", str(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        device = process_group.init_worker("auto", "cpu", timeout_minutes=1)
        assert device.type == "cpu" and dist.get_backend() == "gloo"
        assert os.environ["USE_LIBUV"] == "0"
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        assert store.libuvBackend is False
    finally:
        process_group.destroy()


# ------------------------------------------------------------------ start-multi-gpu.bat


def run_helper(*args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "scripts/start_multi_gpu.py", *args], input=stdin, capture_output=True, text=True,
                          env=launcher_env(**env), cwd=REPO, timeout=patience(300))


SCENARIOS = [
    (("--yes", "--device", "cpu", "--num-gpus", "2", "--config", "#demo", "--dry-run",
      "--config-value", "training.max_steps=2"), "", {"MASTER_ADDR": "127.0.0.1"}),
    (("--yes", "--device", "cpu", "--config", "#demo", "--spawn", "--dry-run"), "", {"MASTER_PORT": "29611"}),
    (("--device", "cpu", "--dry-run"), "#demo\n3\n\nspawn\n", {}),
    (("--device", "cpu", "--dry-run"), "1\n\n\n\n", {}),
    pytest.param(("--yes", "--config", "#demo", "--dry-run"), "", {},  # no GPU here: falls back to CPU processes
                 marks=pytest.mark.slow),  # both ask torch for the GPU count
    (("--yes", "--device", "cpu", "--config", "sd15_lora", "--launcher", "spawn", "--port", "29700",
      "--dry-run"), "", {}),
    (("--yes", "--device", "cpu", "--config", "#demo", "--dry-run", "--config-value", "training.epochs=1"), "",
     {"TANDEM_FORCE_SINGLE_GPU": "1"}),
    # several machines and restarts (#17): asked ("this machine is node K of M"), or given as flags
    (("--device", "cpu", "--config", "#demo", "--num-gpus", "2", "--backend", "gloo", "--launcher", "torchrun",
      "--dry-run"), "2\n1\n\n\n2\n", {"MASTER_ADDR": "10.0.0.5"}),
    (("--yes", "--device", "cpu", "--config", "#demo", "--nnodes", "2", "--node-rank", "1", "--master-addr",
      "10.0.0.5", "--port", "29501", "--max-restarts", "3", "--dry-run"), "", {}),
]


@pytest.mark.parametrize("args, stdin, env", SCENARIOS)
def test_the_bat_logic_gives_the_same_command_as_the_sh(args, stdin, env):
    sh = run_sh(*args, stdin=stdin, **env)
    helper = run_helper(*args, stdin=stdin, **env)
    assert printed_command(helper) == printed_command(sh)
    for line in sh.stdout.splitlines():  # the variables shown before the command
        if "=" in line and not line.startswith("Command:"):
            assert line in helper.stdout.splitlines()
    assert helper.stderr == sh.stderr  # the same questions, defaults and notes


@pytest.mark.parametrize("args, message", [
    (["--num-gpus", "0"], "--num-gpus must be a whole number"),
    (["--backend", "mpi"], "--backend must be nccl or gloo"),
    (["--backend", "nccl"], "--backend nccl needs GPUs"),
    (["--config", "missing.json"], "neither a file nor a preset"),
    (["--device", "tpu"], "--device accepts only 'cpu'"),
    (["--launcher", "mpirun"], "--launcher must be auto, torchrun or spawn"),
    (["--port", "x1"], "--port must be a number"),
    (["--nnodes", "0"], "--nnodes must be a whole number of 1 or more"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank must be 0 to 1"),
    (["--max-restarts", "x"], "--max-restarts must be a whole number"),
])
def test_the_bat_logic_refuses_what_the_sh_refuses(args, message):
    base = {"--config": "#demo", "--num-gpus": "2", "--device": "cpu"}
    given = dict(zip(args[::2], args[1::2]))
    extra = [x for k, v in base.items() if k not in given for x in (k, v)]
    for result in (run_sh("--yes", "--dry-run", *extra, *args), run_helper("--yes", "--dry-run", *extra, *args)):
        assert result.returncode == 2 and message in result.stderr, result.stderr


def windows_plan(*args: str, gpus: int = 2, stdin: str = "", **environ: str):
    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    os.chdir(REPO)
    try:
        plan = start_multi_gpu.plan(list(args), system="Windows", gpu_count=lambda python: gpus,
                                    stdin=io.StringIO(stdin), stdout=out, stderr=err,
                                    environ={"TANDEM_PYTHON": r"C:\t\.venv\Scripts\python.exe", **environ})
    finally:
        os.chdir(previous)
    return plan, out.getvalue(), err.getvalue()


def test_on_windows_the_default_backend_is_gloo_and_the_store_runs_without_libuv():
    plan, _, err = windows_plan("--config", "#demo", "--dry-run", stdin="\n\n\n", USE_LIBUV="1")
    assert "Backend (nccl/gloo) [gloo]" in err and "Number of GPUs [2]" in err
    command = plan.command
    assert command[command.index("--distributed-backend") + 1] == "gloo" and "--device" not in command
    assert plan.env["USE_LIBUV"] == "0"
    with pytest.raises(start_multi_gpu.UsageError, match="Windows builds have no NCCL; use gloo"):
        windows_plan("--yes", "--config", "#demo", "--backend", "nccl")
    # The printed command is quoted the way cmd.exe reads it back.
    assert start_multi_gpu.quoted([r"C:\My Files\python.exe", "#demo"], "Windows") == r'"C:\My Files\python.exe" #demo'


def test_the_bat_only_installs_and_hands_over_to_the_helper():
    bat = BAT.read_text()
    assert b"\r\n" in BAT.read_bytes() and b"\n" not in BAT.read_bytes().replace(b"\r\n", b""), \
        "cmd.exe needs CRLF line endings in .bat files"
    assert '"%PY%" scripts\\start_multi_gpu.py %*' in bat  # every argument, as typed
    assert 'set "USE_LIBUV=0"' in bat
    for needed in ("-m venv .venv", "pip install -e .", "TANDEM_SKIP_INSTALL", "TANDEM_PYTHON", "TANDEM_TORCH_INDEX",
                   "exit /b %ERRORLEVEL%"):
        assert needed in bat, needed
    # The helper takes every option of the shell script.
    sh_options = {line.split()[0].rstrip(",") for line in run_sh("--help").stdout.splitlines()
                  if line.strip().startswith("--")}
    helper_help = run_helper("--help").stdout
    assert sh_options >= {"--yes", "--config", "--num-gpus", "--backend", "--spawn", "--dry-run", "--config-value"}
    assert all(option in helper_help for option in sh_options), sh_options
    # --help needs only the standard library (it is shown before .venv exists).
    clean = subprocess.run([sys.executable, "-S", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "import modules.start_multi_gpu as m; print(sorted(k for k in sys.modules if "
                            "k.split('.')[0] in ('torch', 'numpy', 'diffusers')))", str(REPO)],
                           capture_output=True, text=True, timeout=patience(60))
    assert clean.returncode == 0 and clean.stdout.strip() == "[]", clean.stdout + clean.stderr


@pytest.mark.slow
def test_the_helper_runs_the_command_it_prints(tmp_path):
    """What is checked is that the helper runs the multi-GPU launcher's command it printed, not what that
    launch does: one CPU process (the launcher and one worker, not two) and no samples are enough. Two
    processes through the same launcher: tests/integration/test_launch_safety.py and tests/integration/test_faults.py."""
    result = run_helper("--yes", "--device", "cpu", "--num-gpus", "1", "--config", "#demo",
                        "--config-value", "training.max_steps=1", "--config-value", "sampling.every_n_epochs=0",
                        "--config-value", "general.tensorboard=false",
                        "--config-value", f"general.workspace_dir={Path(tmp_path) / 'run'}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "scripts/train_multi_gpu.py" in result.stdout and (tmp_path / "run").is_dir()
    assert (tmp_path / "run" / "output" / "demo").exists(), "the printed command did not train: no model saved"


def test_several_machines_and_restarts_are_asked_and_passed_on():
    """#17: "this machine is node K of M", node 0's address, a shared port and restarts become the launcher's flags."""
    helper = run_helper("--device", "cpu", "--config", "#demo", "--num-gpus", "2", "--backend", "gloo",
                        "--launcher", "torchrun", "--dry-run", stdin="2\n1\n\n\n2\n", MASTER_ADDR="10.0.0.5")
    assert "This machine is node K of 2; K (0: the one the others connect to) [0]: " in helper.stderr
    command = " ".join(printed_command(helper))
    assert "--nnodes 2 --node-rank 1 --master-addr 10.0.0.5" in command and "--port 29500" in command
    assert command.endswith("--max-restarts 2")
