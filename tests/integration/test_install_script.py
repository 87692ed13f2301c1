"""install.sh and start-ui.sh against a stand-in .venv: its bin/python is a shell script that records its
arguments, so each test sees which pip commands the script would run without running any."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

RECORDER = """#!/bin/sh
# a stand-in Python: records its arguments; fails a pip install of anything named in FAIL_ON
echo "$*" >> "$(dirname "$0")/../../calls"
[ -n "${FAIL_ON:-}" ] && case "$*" in *"$FAIL_ON"*) exit 1 ;; esac
exit 0
"""

MAKES_VENV = """#!/bin/sh
# a stand-in system Python: `--version`, and `-m venv DIR` makes DIR/bin/python the recorder
if [ "$1" = "--version" ]; then echo "Python 3.99.0"; exit 0; fi
mkdir -p "$3/bin" && cp "$(dirname "$0")/recorder" "$3/bin/python" && chmod +x "$3/bin/python"
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A checkout with install.sh, start-ui.sh and a pyproject.toml, and a system Python that makes the
    stand-in .venv."""
    for name in ("install.sh", "start-ui.sh"):
        shutil.copy2(REPO / name, tmp_path / name)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "tandem"\ndependencies = ["torch>=2.4"]\n')
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "recorder").write_text(RECORDER)
    (tools / "python3").write_text(MAKES_VENV)
    for tool in tools.iterdir():
        tool.chmod(0o755)
    return tmp_path


def run(tree: Path, *args: str, script: str = "install.sh", **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the script in `tree`; its output and the stand-in Python's calls during this run."""
    calls = tree / "calls"
    calls.unlink(missing_ok=True)
    environment = {k: v for k, v in os.environ.items() if k not in ("TANDEM_TORCH_SPEC", "PYTHON", "FAIL_ON")}
    environment.update(PYTHON=str(tree / "tools" / "python3"), LC_ALL="C", **env)
    result = subprocess.run(["bash", str(tree / script), *args], capture_output=True, text=True, env=environment,
                            timeout=patience(120))
    return result, (calls.read_text().splitlines() if calls.exists() else [])


PIP = "-m pip install -q --no-compile"


def test_first_install_creates_the_venv_and_installs_torch_then_tandem(tree):
    result, calls = run(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls == [f"{PIP} --upgrade pip", f"{PIP} torch>=2.4", f"{PIP} -e ."], calls
    assert "Creating .venv with Python 3.99.0" in result.stdout, result.stdout
    assert "Installing Tandem into .venv (torch: torch>=2.4)" in result.stdout, result.stdout
    again, calls = run(tree)
    assert again.returncode == 0 and calls == [] and again.stdout == "", (again.stdout, calls)


def test_start_ui_keeps_an_install_made_with_another_torch_spec(tree):
    """The issue's steps: `TANDEM_TORCH_SPEC=torch==2.13.0 ./install.sh dev`, then `./start-ui.sh` without the
    variable: nothing is installed again, the GUI starts."""
    result, calls = run(tree, "dev", TANDEM_TORCH_SPEC="torch==2.13.0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls == [f"{PIP} --upgrade pip", f"{PIP} torch==2.13.0", f"{PIP} -e .[dev]"], calls
    ui, calls = run(tree, "--some-flag", script="start-ui.sh")
    assert ui.returncode == 0, ui.stdout + ui.stderr
    assert calls == ["scripts/train_ui.py --some-flag"], calls
    assert ui.stdout == "", ui.stdout
    for args in ((), ("dev",)):  # the base install after the dev one, and the dev one again: nothing to do
        again, calls = run(tree, *args)
        assert again.returncode == 0 and calls == [] and again.stdout == "", (args, again.stdout, calls)
    same, calls = run(tree, "dev", TANDEM_TORCH_SPEC="torch==2.13.0")
    assert same.returncode == 0 and calls == [], calls


def test_only_an_explicitly_different_spec_installs_torch_again_and_says_why_in_one_line(tree):
    run(tree, "dev", TANDEM_TORCH_SPEC="torch==2.13.0")
    result, calls = run(tree, "dev", TANDEM_TORCH_SPEC="torch==2.14.0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls == [f"{PIP} --upgrade pip", f"{PIP} torch==2.14.0", f"{PIP} -e .[dev]"], calls
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and "torch==2.13.0 -> torch==2.14.0" in lines[0] and "TANDEM_TORCH_SPEC" in lines[0], lines
    # the new spec is what the stamp holds now: without the variable, nothing happens
    again, calls = run(tree)
    assert again.returncode == 0 and calls == [], calls


def test_a_changed_pyproject_installs_tandem_again_keeping_torch(tree):
    run(tree, "dev", TANDEM_TORCH_SPEC="torch==2.13.0")
    with open(tree / "pyproject.toml", "a") as f:
        f.write('# a new dependency\n')
    result, calls = run(tree, "dev")
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls == [f"{PIP} --upgrade pip", f"{PIP} -e .[dev]"], calls
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and "pyproject.toml changed" in lines[0] and "torch kept (torch==2.13.0)" in lines[0], lines
    again, calls = run(tree, "dev")
    assert again.returncode == 0 and calls == [], calls


def test_dev_after_base_adds_the_extras_only(tree):
    run(tree, TANDEM_TORCH_SPEC="torch==2.13.0")
    result, calls = run(tree, "dev")
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls == [f"{PIP} --upgrade pip", f"{PIP} -e .[dev]"], calls
    assert "the dev extras are not installed yet" in result.stdout and "torch kept (torch==2.13.0)" in result.stdout


def test_a_stamp_written_by_the_previous_install_sh_is_read(tree):
    """Before the spec had a line of its own the stamp held `<pyproject.toml> <spec>`: still a working install."""
    run(tree, "dev", TANDEM_TORCH_SPEC="torch==2.13.0")
    project = (tree / "pyproject.toml").read_text().rstrip("\n")
    (tree / ".venv" / ".tandem-installed-dev").write_text(f"{project} torch==2.13.0")
    for args, env in (((), {}), (("dev",), {}), (("dev",), {"TANDEM_TORCH_SPEC": "torch==2.13.0"})):
        result, calls = run(tree, *args, **env)
        assert result.returncode == 0 and calls == [], (args, env, result.stdout, calls)
    changed, calls = run(tree, "dev", TANDEM_TORCH_SPEC="torch==2.14.0")
    assert f"{PIP} torch==2.14.0" in calls and "torch==2.13.0 -> torch==2.14.0" in changed.stdout, (changed.stdout, calls)


def test_a_failed_install_writes_no_stamp_and_is_tried_again(tree):
    failed, calls = run(tree, FAIL_ON="-e .")
    assert failed.returncode != 0 and calls[-1] == f"{PIP} -e .", (failed.stdout, calls)
    assert not (tree / ".venv" / ".tandem-installed-base").exists()
    again, calls = run(tree)
    assert again.returncode == 0 and calls[-1] == f"{PIP} -e .", (again.stdout, calls)
