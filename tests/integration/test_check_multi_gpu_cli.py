"""scripts/check_multi_gpu.py's command line: `--help` and argument errors answer without importing PyTorch,
`--plan-for` for a model of published sizes too, and `--plan-for 2x24` as the README writes it (no
`--config-path`) plans for `#demo`, as the README and `--help` say."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_multi_gpu.py"


def check(*args: str, importtime: bool = False, **env: str) -> subprocess.CompletedProcess:
    command = [sys.executable, *(["-X", "importtime"] if importtime else []), str(SCRIPT), *args]
    # the limit only ends a hang (these answer in about a second on an idle machine; the demo's plan builds it)
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=patience(900),
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **env})


def imported_torch(result: subprocess.CompletedProcess) -> list[str]:
    """The `-X importtime` lines of torch's own modules (a module whose name merely contains "torch" is not one)."""
    return [ln for ln in result.stderr.splitlines()
            if ln.startswith("import time:") and re.search(r"\|\s*torch(\.|$)", ln)]


def test_help_answers_without_importing_torch():
    result = check("--help", importtime=True)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert not imported_torch(result), "--help imported torch: " + "\n".join(imported_torch(result)[:5])
    assert "--plan-for" in result.stdout and "'#demo'" in result.stdout, result.stdout


@pytest.mark.parametrize("args, words", [(("--plan-for", "2y24"), "write the cards as 2x24"),
                                         (("--nnodes", "two"), "--nnodes"),
                                         (("--no-such-flag",), "unrecognized arguments")])
def test_argument_errors_answer_without_importing_torch(args, words):
    result = check(*args, importtime=True)
    errors = "\n".join(ln for ln in result.stderr.splitlines() if not ln.startswith("import time:"))
    assert result.returncode == 2 and words in errors, f"exit {result.returncode}: {errors}"
    assert "Traceback" not in errors, errors
    assert not imported_torch(result), f"{args} imported torch: " + "\n".join(imported_torch(result)[:5])


def test_plan_for_a_preset_of_published_sizes_imports_no_torch():
    result = check("--config-path", "flux_lora", "--plan-for", "2x24", importtime=True)
    out = result.stdout
    assert result.returncode == 0 and "Memory plan for 2 GPU(s) of 24 GiB" in out, out + result.stderr[-3000:]
    assert not imported_torch(result), "imported torch: " + "\n".join(imported_torch(result)[:5])


@pytest.mark.slow
def test_plan_for_as_the_readme_writes_it_plans_for_the_demo(tandem_home):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "check_multi_gpu.py --plan-for 2x24" in readme or "`--plan-for 2x24`" in readme, \
        "the README no longer shows --plan-for 2x24: update this test to its command"
    assert "#demo" in readme.split("--plan-for 2x24", 1)[1][:400], "the README does not say --plan-for's default"
    result = check("--plan-for", "2x24", TANDEM_HOME=str(tandem_home))
    seen = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr (end):\n{result.stderr[-3000:]}"
    assert result.returncode == 0, seen
    assert "No --config-path: the plan for '#demo'" in result.stdout, seen
    assert "Memory plan for 2 GPU(s) of 24 GiB" in result.stdout and "nothing ran on a GPU" in result.stdout, seen
    assert "Traceback" not in result.stderr, seen


@pytest.mark.slow
def test_the_full_check_still_runs_behind_the_torch_free_command_line():
    result = check("--skip-gloo", "--json")
    seen = f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr (end):\n{result.stderr[-3000:]}"
    assert result.returncode in (0, 1) and '"problems"' in result.stdout, seen
