"""scripts/train_ui.py (what start-ui.sh runs) without a display: one line naming the problem and what works
without a window, exit status 2, no traceback; with one, the check passes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "train_ui.py"


def run_ui(display: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    if display is not None:
        env["DISPLAY"] = display
    # the limit only ends a hang: on an idle machine this takes well under a second
    return subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=patience(300))


@pytest.mark.skipif(sys.platform != "linux", reason="$DISPLAY is X11's")
@pytest.mark.parametrize("display, words", [(None, "$DISPLAY is not set"),
                                            (":99999", "the X server at DISPLAY=:99999 cannot be reached")])
def test_no_display_is_one_line_naming_what_to_use_instead(display, words):
    result = run_ui(display)
    seen = f"exit {result.returncode}; stdout {result.stdout!r}; stderr {result.stderr!r}"
    assert result.returncode == 2, seen
    assert "Traceback" not in result.stderr + result.stdout, seen
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and result.stdout == "", seen
    line = lines[0]
    for part in ("no display", words, "./start-multi-gpu.sh", "scripts/train.py", "scripts/train_remote.py"):
        assert part in line, f"{part!r} not in {line!r}"


def test_with_a_display_the_check_passes(display):
    check = f"import runpy; print(runpy.run_path({str(SCRIPT)!r}, run_name='not_main')['display_problem']())"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "DISPLAY": display}, timeout=patience(300))
    assert result.returncode == 0 and result.stdout.strip() == "None", result.stdout + result.stderr
