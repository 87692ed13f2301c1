"""Running start-multi-gpu.sh (and the .bat's helper) as a user runs them, and reading the command they print:
shared by tests/integration/test_launcher_scripts.py and tests/unit/test_windows_launch.py."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.patience import patience

REPO = Path(__file__).resolve().parents[1]
SH = REPO / "start-multi-gpu.sh"
BAT = REPO / "start-multi-gpu.bat"
PY = sys.executable


def launcher_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "NCCL_DEBUG",
                        "NCCL_P2P_DISABLE", "TANDEM_FORCE_SINGLE_GPU")}
    env.update(TANDEM_SKIP_INSTALL="1", TANDEM_PYTHON=PY, HF_HUB_OFFLINE="1", LC_ALL="C", **extra)
    return env


def run_sh(*args: str, stdin: str = "", script: Path = SH, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], input=stdin, capture_output=True, text=True,
                          env=launcher_env(**env), timeout=patience(600))


def printed_command(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("Command: ")]
    assert len(lines) == 1, result.stdout
    return shlex.split(lines[0][len("Command: "):])
