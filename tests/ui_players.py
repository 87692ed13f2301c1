"""Stand-ins the GUI tests start instead of training, and small makers of the files a workspace holds."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ui.run_controller import RunController

from tests.gui.test_ui_widgets import _png, pump

EVENT_PLAYER = """
import json, sys, time
for item in json.loads(sys.argv[1]):
    if isinstance(item, (int, float)):
        time.sleep(item)
    elif isinstance(item, str):
        print(item, flush=True)
    else:
        print("@tandem " + json.dumps(item), flush=True)
sys.exit(int(sys.argv[2]))
"""


class PlayedController(RunController):
    """Plays the next `runs` entry - events (dicts), log lines (strings) and pauses (seconds) - instead of
    training; records each start's command line as Start built it."""

    def __init__(self):
        super().__init__()
        self.runs: list[tuple[list, int]] = []
        self.started: list[list[str]] = []

    def start(self, cfg, visible_gpus, command=None, resume=None):
        from ui.launch_command import build_command, run_config
        self.started.append(build_command(run_config(cfg, visible_gpus), "gui-config.json", visible_gpus,
                                          resume=resume))
        items, code = self.runs.pop(0)
        return super().start(cfg, visible_gpus, command=[sys.executable, "-c", EVENT_PLAYER, json.dumps(items),
                                                         str(code)])


def run_to_the_end(app, controller, script: list[str]) -> None:
    """Start the ScriptedController's next run from the Run tab and wait for its end."""
    controller.script = [script]
    app.run_view.start_button.invoke()
    assert controller.state.status == "running", app.run_view.error_text()
    assert pump(app, lambda: not controller.state.active, timeout=30), "the scripted run did not end"
    pump(app)


def make_backup(workspace: Path, run: str, step: int) -> Path:
    import torch

    from modules.trainer.backup import write_backup
    return write_backup(workspace / "backups", run, step, {"w": torch.zeros(1)}, {}, {}, keep=3)


def make_script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def make_samples(workspace: Path, run: str, steps: list[int], prompts: list[str]) -> None:
    folder = workspace / "samples" / run
    folder.mkdir(parents=True, exist_ok=True)
    for step in steps:
        for i in range(len(prompts)):
            _png(folder / f"step-{step:07d}-{i}.png")
    (workspace / "config").mkdir(parents=True, exist_ok=True)
    (workspace / "config" / f"{run}.json").write_text(json.dumps(
        {"sampling": {"prompts": [{"prompt": p} for p in prompts]}}))
