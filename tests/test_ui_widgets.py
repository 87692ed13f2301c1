"""The customtkinter views under Xvfb, driven through their variables and `.invoke()`/`.toggle()`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from modules.config import config_to_dict, read_json
from ui.binding import field_doc
from ui.gpu_info import GpuInfo
from ui.run_controller import RunController
from ui.settings import RecentConfigs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def display():
    if shutil.which("Xvfb") is None:
        pytest.fail("Xvfb is not installed; run-tests.sh installs it (apt-get install xvfb)")
    number = next(n for n in range(71, 200) if not Path(f"/tmp/.X{n}-lock").exists()
                  and not Path(f"/tmp/.X11-unix/X{n}").exists())
    server = subprocess.Popen(["Xvfb", f":{number}", "-screen", "0", "1280x900x24", "-nolisten", "tcp"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not Path(f"/tmp/.X11-unix/X{number}").exists():
        assert server.poll() is None, "Xvfb exited at start"
        assert time.monotonic() < deadline, "Xvfb did not open its socket"
        time.sleep(0.05)
    old = os.environ.get("DISPLAY")
    os.environ["DISPLAY"] = f":{number}"
    yield f":{number}"
    server.terminate()
    server.wait(5)
    if old is None:
        os.environ.pop("DISPLAY", None)
    else:
        os.environ["DISPLAY"] = old


class FakeDialogs:
    """Answers the window's questions the way a test decides."""

    def __init__(self):
        self.errors: list[tuple[str, str]] = []
        self.save_answer: bool | None = False
        self.save_path = ""

    def ask_save_changes(self, name):
        return self.save_answer

    def ask_yes_no(self, title, text):
        return True

    def ask_open_path(self):
        return ""

    def ask_save_path(self, suggested):
        return self.save_path

    def show_error(self, title, text):
        self.errors.append((title, text))


def pump(app, until=lambda: False, timeout=0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        app.update()
        if until():
            return True
        time.sleep(0.02)
    return until()


def make_app(tmp_path, gpus=(), controller=None):
    from ui.views.app import TandemApp
    dialogs = FakeDialogs()
    app = TandemApp(recent=RecentConfigs(tmp_path / "home"), gpu_probe=lambda: list(gpus),
                    controller=controller, dialogs=dialogs)
    assert pump(app, lambda: not app.multi_gpu.detecting, timeout=5)
    app.binder.fields["general.workspace_dir"].var.set(str(tmp_path / "ws"))
    return app, dialogs


@pytest.fixture
def app_factory(display, tmp_path):
    apps = []

    def factory(**kwargs):
        app, dialogs = make_app(tmp_path, **kwargs)
        apps.append(app)
        return app, dialogs

    yield factory
    for app in apps:
        app.controller.terminate()
        try:
            app.destroy()
        except Exception:
            pass


def test_preset_edit_save_and_reload(app_factory, tmp_path):
    app, dialogs = app_factory()
    assert app.load("#demo") and app.model.source_name == "#demo"
    assert app.binder.fields["data.resolution"].var.get() == "64"
    app.binder.fields["training.batch_size"].var.set("4")
    app.binder.fields["training.learning_rate"].var.set("2e-4")
    app.binder.fields["training.gradient_checkpointing"].var.set(True)
    assert app.title().endswith("*")
    target = tmp_path / "mine.json"
    dialogs.save_path = str(target)
    app.save_button.invoke()
    assert not app.title().endswith("*")
    saved = read_json(target)
    assert saved == json.loads(json.dumps(config_to_dict(app.model.cfg)))
    assert saved["training"]["batch_size"] == 4 and saved["training"]["learning_rate"] == 2e-4
    assert saved["training"]["gradient_checkpointing"] is True

    # Loading a file updates every widget, list rows included.
    saved["training"]["batch_size"] = 7
    saved["data"]["concepts"].append({"path": "builtin:demo-shapes", "repeats": 3})
    target.write_text(json.dumps(saved))
    assert app.load(str(target))
    assert app.binder.fields["training.batch_size"].var.get() == "7"
    assert app.binder.fields["data.concepts[1].repeats"].var.get() == "3"
    assert len(app.concepts.rows) == 2
    app.concepts.remove(1)
    assert len(app.concepts.rows) == 1 and app.title().endswith("*")
    # The file opened last is the one restored at the next start.
    assert RecentConfigs(tmp_path / "home").last == str(target.resolve())


def test_invalid_values_are_marked_and_start_is_refused(app_factory):
    app, _ = app_factory()
    batch = app.binder.fields["training.batch_size"]
    batch.var.set("0")
    assert "training.batch_size" in batch.message and batch.error_label.winfo_manager() == "grid"
    assert batch.widget.cget("border_color") == "#d94040"
    lr = app.binder.fields["training.learning_rate"]
    before = app.model.cfg.training.learning_rate
    lr.var.set("fast")
    assert "expected a number" in lr.message and app.model.cfg.training.learning_rate == before
    assert app.run_view.start() is False
    shown = app.run_view.error_text()
    assert "training.batch_size" in shown and "training.learning_rate" in shown
    assert app.controller.state.status == "idle"
    batch.var.set("2")
    assert batch.message == "" and batch.error_label.winfo_manager() == ""
    assert batch.tooltip.text == field_doc("training.batch_size")  # tooltips come from the docstrings


def test_multi_gpu_frame_writes_the_config(app_factory):
    gpus = [GpuInfo(0, "Fake GPU", 81920), GpuInfo(1, "Fake GPU", 81920)]
    app, _ = app_factory(gpus=gpus)
    frame = app.multi_gpu
    app.binder.fields["training.batch_size"].var.set("8")
    app.binder.fields["training.learning_rate"].var.set("1e-4")
    frame.enable.widget.toggle()
    assert app.model.cfg.multi_gpu.enabled is True
    frame.lr_scaling.var.set("linear")
    assert frame.summary.cget("text") == "World size 2 · global batch 16 (8 x 1 x 2) · LR 1e-4 -> 2e-4 (linear)"
    assert all(check.cget("state") == "normal" for check in frame.gpu_checks)
    frame.gpu_checks[2].toggle()  # untick GPU 1
    assert (app.model.cfg.multi_gpu.device_indexes, app.model.cfg.multi_gpu.num_gpus) == ("0", 1)
    assert frame.summary.cget("text").startswith("World size 1 ")
    frame.gpu_checks[0].toggle()  # "All GPUs"
    assert (app.model.cfg.multi_gpu.device_indexes, app.model.cfg.multi_gpu.num_gpus) == ("", 0)
    frame.torchrun.toggle()
    assert app.model.cfg.multi_gpu.launcher == "spawn"
    app.binder.fields["training.gradient_accumulation_steps"].var.set("2")
    assert "global batch 32 (8 x 2 x 2)" in frame.summary.cget("text")


def test_multi_gpu_frame_without_gpus_offers_cpu_processes(app_factory):
    app, _ = app_factory(gpus=[])
    frame = app.multi_gpu
    assert all(check.cget("state") == "disabled" for check in frame.gpu_checks)
    assert "needs 2 or more" in frame.explanation.cget("text")
    frame.cpu_menu.set("3")
    frame._cpu_chosen("3")  # what the menu's command does when a user picks an entry
    cfg = app.model.cfg
    assert (cfg.general.device, cfg.multi_gpu.enabled, cfg.multi_gpu.num_gpus) == ("cpu", True, 3)
    assert frame.summary.cget("text").startswith("CPU processes 3 ")
    assert app.binder.fields["general.device"].var.get() == "cpu"


CRASHING_TRAINER = textwrap.dedent("""
    print('@tandem {"type": "status", "text": "loading"}', flush=True)
    print("Traceback (most recent call last):", flush=True)
    print("RuntimeError: the fake trainer fell over", flush=True)
    raise SystemExit(3)
""")


class CrashingController(RunController):
    def start(self, cfg, visible_gpus, command=None, resume=None):
        self.resumed = resume
        return super().start(cfg, visible_gpus, command=[sys.executable, "-c", CRASHING_TRAINER])


def test_a_crashing_run_shows_its_error_and_the_gui_stays_usable(app_factory):
    app, _ = app_factory(controller=CrashingController())
    assert app.run_view.start_button.cget("state") == "normal"
    app.run_view.start_button.invoke()
    assert pump(app, lambda: app.controller.state.status == "failed", timeout=20)
    pump(app)
    error = app.run_view.error_text()
    assert "exit code 3" in error and "the fake trainer fell over" in error
    assert app.run_view.start_button.cget("state") == "normal"
    assert "fell over" in app.run_view.log.get("1.0", "end")
    app.binder.fields["training.epochs"].var.set("2")  # still editable
    assert app.model.cfg.training.epochs == 2


def test_continue_button_resumes_the_newest_backup(app_factory, tmp_path):
    from modules.trainer.backup import write_backup

    app, _ = app_factory(controller=CrashingController())
    app.binder.fields["general.workspace_dir"].var.set(str(tmp_path / "ws"))
    app.run_view._update_buttons()
    button = app.run_view.continue_button
    assert button.cget("state") == "disabled"  # nothing to continue yet
    write_backup(tmp_path / "ws" / "backups", "run-a", 40, {"w": torch.zeros(1)}, {}, {}, keep=2)
    app.run_view._update_buttons()
    assert button.cget("state") == "normal" and button.cget("text") == "Continue from step 40"
    button.invoke()
    assert app.controller.resumed == "latest"
    assert pump(app, lambda: not app.controller.state.active, timeout=20)
    app.run_view.start_button.invoke()
    assert app.controller.resumed is None  # Start is always a new run


@pytest.mark.slow
def test_demo_on_two_cpu_processes_from_the_gui(app_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    app, _ = app_factory()
    assert app.load("#demo")
    app.binder.fields["general.workspace_dir"].var.set(str(tmp_path / "ws"))
    app.multi_gpu._cpu_chosen("2")
    view = app.run_view
    view.start_button.invoke()
    assert app.controller.state.status == "running", view.error_text()
    assert "--num-gpus" in app.controller.state.command and "cpu" in app.controller.state.command
    assert pump(app, lambda: app.controller.state.step >= 2 or not app.controller.state.active, timeout=150), \
        "no progress from the demo run:\n" + "\n".join(app.controller.log)
    assert app.controller.state.status == "running", app.controller.state.error
    assert app.controller.state.run_info.get("world_size") == 2
    assert "Epoch 1/" in view.progress_text.cget("text") and view.progress.get() > 0
    view.stop_button.invoke()
    assert pump(app, lambda: not app.controller.state.active, timeout=90)
    assert app.controller.state.status == "stopped", app.controller.state.error
    assert app.controller.state.step < app.controller.state.total_steps


@pytest.mark.slow
def test_check_setup_shows_the_report(app_factory):
    """The "Check setup" button runs scripts/check_multi_gpu.py on the current config and shows its report."""
    app, _ = app_factory()
    assert app.load("#demo")
    frame = app.multi_gpu
    frame.check_button.invoke()
    assert pump(app, lambda: frame.check_button.cget("text") == "Check setup", timeout=240)
    report = frame.check_output.get("1.0", "end")
    assert "check_multi_gpu.py" in report and "--config-path" in report
    assert "No CUDA GPU" in report or "GPU" in report
    assert "No problems found." in report, report[-1500:]


def _shown(app, path: str) -> bool:
    field = app.binder.fields[path]
    return field.visible and all(widget.winfo_manager() == "grid" for widget in field.row_widgets)


def test_model_family_rows_appear_and_disappear_with_the_model_type(app_factory):
    """A family's own settings show only when they apply (ui/field_visibility.py)."""
    app, _ = app_factory()
    assert app.load("#demo")
    assert _shown(app, "model.prediction_type") and _shown(app, "training.min_snr_gamma")
    assert not _shown(app, "model.t5_max_length") and not _shown(app, "training.flux_guidance")

    app.binder.fields["model.base_model"].var.set("builtin:demo-flux")
    pump(app)
    assert _shown(app, "model.t5_max_length") and _shown(app, "training.flux_guidance")
    assert _shown(app, "model.components_folder")
    assert not _shown(app, "model.prediction_type")
    # #demo sets min-SNR 5, which Flux does not use: the field stays in sight with its problem.
    assert _shown(app, "training.min_snr_gamma")
    assert "does not apply" in app.binder.fields["training.min_snr_gamma"].message
    app.binder.fields["training.min_snr_gamma"].var.set("0")
    pump(app)
    assert not _shown(app, "training.min_snr_gamma")

    app.binder.fields["model.model_type"].var.set("sd3")
    pump(app)
    assert not _shown(app, "training.flux_guidance") and _shown(app, "training.timestep_logit_std")
    app.binder.fields["model.base_model"].var.set("builtin:demo")
    app.binder.fields["model.model_type"].var.set("auto")
    pump(app)
    assert _shown(app, "model.prediction_type") and not _shown(app, "training.timestep_logit_mean")
