"""start-multi-gpu.sh, run here (start-multi-gpu.bat and its helper: tests/unit/test_windows_launch.py)."""
from __future__ import annotations

import shutil
import subprocess

import pytest
from tests.launcher_helpers import PY, REPO, SH, launcher_env, printed_command, run_sh
from tests.patience import patience

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_help_lists_options_and_environment():
    result = run_sh("--help")
    assert result.returncode == 0
    for word in ("--yes", "--config", "--num-gpus", "--backend", "--spawn", "--port", "--device cpu",
                 "--config-value", "--dry-run", "TANDEM_SKIP_INSTALL", "TANDEM_FORCE_SINGLE_GPU", "NCCL_DEBUG"):
        assert word in result.stdout, word


def test_non_interactive_cpu_command():
    result = run_sh("--yes", "--device", "cpu", "--num-gpus", "2", "--config", "#demo", "--dry-run",
                    "--config-value", "training.max_steps=2", MASTER_ADDR="127.0.0.1")
    assert printed_command(result) == [
        PY, "scripts/train_multi_gpu.py", "--config-path", "#demo", "--num-gpus", "2",
        "--distributed-backend", "gloo", "--device", "cpu", "--config-value", "training.max_steps=2"]
    assert "MASTER_ADDR=127.0.0.1" in result.stdout and "MASTER_PORT=(unset)" in result.stdout


def test_port_comes_from_master_port_and_spawn_flag():
    result = run_sh("--yes", "--device", "cpu", "--config", "#demo", "--spawn", "--dry-run", MASTER_PORT="29611")
    command = printed_command(result)
    assert command[command.index("--port") + 1] == "29611"
    assert command[command.index("--launcher") + 1] == "spawn"


def test_interactive_answers_from_stdin():
    # Answers: config, number of processes, backend (default), launcher.
    result = run_sh("--device", "cpu", "--dry-run", stdin="#demo\n3\n\nspawn\n")
    assert printed_command(result) == [
        PY, "scripts/train_multi_gpu.py", "--config-path", "#demo", "--num-gpus", "3",
        "--distributed-backend", "gloo", "--launcher", "spawn", "--device", "cpu"]
    assert "Number of CPU processes [2]" in result.stderr


def test_interactive_preset_number_picks_that_file():
    presets = sorted(p.name for p in (REPO / "training_presets").glob("*.json"))
    assert presets, "training_presets/ holds no preset"
    result = run_sh("--device", "cpu", "--dry-run", stdin="1\n\n\n\n")
    command = printed_command(result)
    assert command[command.index("--config-path") + 1] == f"training_presets/{presets[0]}"
    assert command[command.index("--num-gpus") + 1] == "2"


def test_force_single_gpu_runs_train_py():
    result = run_sh("--yes", "--device", "cpu", "--config", "#demo", "--dry-run",
                    "--config-value", "training.epochs=1", TANDEM_FORCE_SINGLE_GPU="1")
    assert printed_command(result) == [
        PY, "scripts/train.py", "--config-path", "#demo", "--config-value", "general.device=cpu",
        "--config-value", "training.epochs=1"]


@pytest.mark.parametrize("args, message", [
    (["--num-gpus", "0"], "--num-gpus must be a whole number"),
    (["--backend", "mpi"], "--backend must be nccl or gloo"),
    (["--backend", "nccl"], "--backend nccl needs GPUs"),
    (["--config", "missing.json"], "neither a file nor a preset"),
    (["--device", "tpu"], "--device accepts only 'cpu'"),
    (["--frobnicate"], "unknown option '--frobnicate'"),
])
def test_bad_input_is_refused_with_a_message(args, message):
    base = {"--config": "#demo", "--num-gpus": "2", "--device": "cpu"}
    given = dict(zip(args[::2], args[1::2])) if len(args) % 2 == 0 else {}
    extra = [x for k, v in base.items() if k not in given for x in (k, v)]
    result = run_sh("--yes", "--dry-run", *extra, *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_install_runs_unless_skipped(tmp_path):
    # A copy of the launcher (and the helper it hands over to) beside a stand-in install.sh that only records that it ran.
    shutil.copy(SH, tmp_path / "start-multi-gpu.sh")
    for helper in ("scripts/start_multi_gpu.py", "modules/start_multi_gpu.py", "modules/__init__.py"):
        (tmp_path / helper).parent.mkdir(exist_ok=True)
        shutil.copy(REPO / helper, tmp_path / helper)
    (tmp_path / "install.sh").write_text("#!/usr/bin/env bash\ntouch installed\n")
    (tmp_path / "install.sh").chmod(0o755)
    (tmp_path / "training_presets").mkdir()
    args = ("--yes", "--device", "cpu", "--config", "#demo", "--dry-run")
    skipped = run_sh(*args, script=tmp_path / "start-multi-gpu.sh")
    assert skipped.returncode == 0 and not (tmp_path / "installed").exists()
    env = launcher_env()
    del env["TANDEM_SKIP_INSTALL"]
    ran = subprocess.run(["bash", str(tmp_path / "start-multi-gpu.sh"), *args], capture_output=True,
                         text=True, env=env, timeout=patience(120))
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "installed").exists()


@pytest.mark.slow
def test_end_to_end_two_cpu_processes_on_the_flux_demo(tmp_path):
    """The launcher as a new user runs it, on the built-in Flux demo (a Flux LoRA on 2 processes; the
    SD demo runs through the same launch path in tests/integration/test_distributed.py)."""
    result = run_sh("--yes", "--device", "cpu", "--num-gpus", "2", "--config", "#demo_flux",
                    "--config-value", "training.max_steps=2", "--config-value", "training.method=lora",
                    "--config-value", f"general.workspace_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "scripts/train_multi_gpu.py" in result.stdout
    assert list((tmp_path / "run" / "output").glob("*.safetensors")), "no LoRA was saved"


def test_the_sh_only_installs_and_hands_over_to_the_helper_like_the_bat(tmp_path):
    """One copy of the questions and checks (modules/start_multi_gpu.py) for both scripts."""
    sh = SH.read_text()
    assert 'exec "$python" scripts/start_multi_gpu.py "$@"' in sh and "./install.sh" in sh
    assert len([line for line in sh.splitlines() if line.strip() and not line.lstrip().startswith("#")]) < 30
    # --help before anything is installed: the helper needs only the standard library.
    for helper in ("start-multi-gpu.sh", "scripts/start_multi_gpu.py", "modules/start_multi_gpu.py", "modules/__init__.py"):
        (tmp_path / helper).parent.mkdir(exist_ok=True)
        shutil.copy(REPO / helper, tmp_path / helper)
    env = {k: v for k, v in launcher_env().items() if k != "TANDEM_PYTHON"}
    shown = subprocess.run(["bash", str(tmp_path / "start-multi-gpu.sh"), "--help"], capture_output=True, text=True,
                           env=env, timeout=patience(120))
    assert shown.returncode == 0 and "--num-gpus" in shown.stdout and not (tmp_path / ".venv").exists(), shown.stderr
