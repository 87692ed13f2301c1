"""The customtkinter views under Xvfb, driven through their variables and `.invoke()`/`.toggle()`."""
from __future__ import annotations

import gc
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from modules.config import config_to_dict, read_json
from ui.binding import field_doc, plain_text
from ui.gpu_info import GpuInfo
from ui.run_controller import RunController
from ui.settings import RecentConfigs
from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]


class FakeDialogs:
    """Answers the window's questions the way a test decides."""

    def __init__(self):
        self.errors: list[tuple[str, str]] = []
        self.save_answer: bool | None = False
        self.save_path = ""
        self.yes_no_answer = True
        self.questions: list[str] = []
        self.file_dialogs: list[tuple[str, str | None]] = []
        """(kind, folder it opened in) of every file or folder dialog."""
        self.chosen_path = ""
        """What the next file or folder dialog answers ("": Cancel)."""

    def ask_save_changes(self, name):
        return self.save_answer

    def ask_yes_no(self, title, text):
        self.questions.append(text)
        return self.yes_no_answer

    def ask_open_path(self, start=None):
        self.file_dialogs.append(("open config", start))
        return ""

    def ask_save_path(self, suggested, start=None):
        return self.save_path

    def ask_folder(self, title, start):
        self.file_dialogs.append(("folder", start))
        return self.chosen_path

    def ask_file(self, title, start):
        self.file_dialogs.append(("file", start))
        return self.chosen_path

    def show_error(self, title, text):
        self.errors.append((title, text))


def pump(app, until=None, timeout=0.3):
    """Runs the window's event loop until `until()` holds (waiting at most `timeout` on an idle machine, scaled by
    `patience`: a hang detector) or, without `until`, for `timeout` seconds."""
    if until is None:
        until = lambda: False  # noqa: E731
    else:
        timeout = patience(timeout)
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
    # The closed windows' Tk objects (fonts, images) are freed now, on the thread that owns their interpreter.
    # Left to a later collection on a worker thread (a memory estimate's), a font's __del__ waited forever for
    # an interpreter nobody runs any more, and the estimates queued behind it never came.
    gc.collect()


@pytest.fixture(scope="module")
def shared_window(display, tmp_path_factory):
    """One window for the module's tests that only use it as a new one is (building one costs seconds of CPU,
    many times that on a loaded CI machine); `window` hands it to each test as `make_app` leaves a new one.
    A test that closes the window, reopens one or looks at the settings folder a window was built with takes
    `app_factory` instead."""
    app, dialogs = make_app(tmp_path_factory.mktemp("shared-window"))
    yield app, dialogs, app.run_view.monitor
    app.controller.terminate()
    app.run_view.tensorboard.close()
    try:
        app.destroy()
    except Exception:
        pass
    gc.collect()  # as in app_factory: the window's Tk objects freed on the Tk thread


@pytest.fixture
def window(shared_window, tmp_path):
    """`app_factory`'s stand-in for the tests that may share the module's window: `window(gpus=..., controller=...)`
    gives it back with the demo preset, the test's own workspace (tmp_path / "ws"), settings folder, GPUs,
    controller and answers, at its first size on the General tab, nothing of an earlier run on the Run tab."""
    app, dialogs, monitor = shared_window

    def reuse(gpus=(), controller=None):
        from ui.external import TensorBoard
        from ui.views.remote_frame import THIS_MACHINE
        gc.collect()  # what the last test left in cycles, freed here on the Tk thread (app_factory's teardown)
        app.controller.terminate()
        app.run_view.tensorboard.close()
        dialogs.__dict__.clear()
        dialogs.__init__()
        app.recent = RecentConfigs(tmp_path / "home")
        app.geometry("1100x820+0+0")
        app.tabs.set("General")
        app._gpus_found(list(gpus))
        app.model.load_file("#demo")
        app._show_current_choice()
        controller = controller or RunController()
        tensorboard = TensorBoard(controller.python)
        app.controller = app.remote.local = controller
        app.remote.local_tensorboard = tensorboard
        app.remote.menu.set(THIS_MACHINE)
        app.remote.choose(THIS_MACHINE)  # the Run tab shows this machine's run, with the new controller
        app.binder.fields["general.workspace_dir"].var.set(str(tmp_path / "ws"))
        app.run_view.monitor = monitor
        app.run_view._hide_notice()
        if app.crash_text():
            app.crash_dismiss.invoke()
        pump(app, timeout=0.1)
        gc.collect()  # the replaced GPU check boxes' Tk variables, here on the Tk thread
        return app, dialogs

    yield reuse
    app.controller.terminate()
    gc.collect()


def test_a_closed_window_collected_on_another_thread_leaves_the_process_running(display):
    """The cyclic collector runs on whichever thread allocates when it is due: a closed window left in a
    reference cycle was freed on a worker thread, and Tk aborted the test process there (the `display`
    fixture keeps every interpreter for that reason). Here the process survives or the worker crashes."""
    import threading
    import tkinter

    def open_and_close() -> None:
        window = tkinter.Tk()
        window.itself = window  # a cycle: only the collector frees it
        window.destroy()
    open_and_close()
    collector = threading.Thread(target=gc.collect, name="not-the-tk-thread")
    collector.start()
    collector.join()


@pytest.mark.slow
def test_preset_edit_save_and_reload(window, tmp_path):
    app, dialogs = window()
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


@pytest.mark.slow
def test_invalid_values_are_marked_and_start_is_refused(window):
    app, _ = window()
    batch = app.binder.fields["training.batch_size"]
    batch.var.set("0")
    # Under the field: the message without the field's own path.
    assert batch.message.startswith("0 is not allowed") and batch.error_label.winfo_manager() == "grid"
    assert batch.widget.cget("border_color") == "#d94040"
    lr = app.binder.fields["training.learning_rate"]
    before = app.model.cfg.training.learning_rate
    lr.var.set("fast")
    assert "expected a number" in lr.message and app.model.cfg.training.learning_rate == before
    assert app.run_view.start() is False
    shown = app.run_view.error_text()
    # Start's list names the tab and the label a user sees, not config paths.
    assert "Training › Batch size per GPU: 0 is not allowed" in shown
    assert "Training › Learning rate: expected a number" in shown
    assert "training.batch_size" not in shown and "training.learning_rate" not in shown
    assert app.controller.state.status == "idle"
    app.binder.fields["data.concepts[0].repeats"].var.set("0")
    assert any(p.startswith("Data › Concepts, row 1 › Repeats: 0 is not allowed")
               for p in app.binder.all_problems(check_paths=False))
    app.binder.fields["data.concepts[0].repeats"].var.set("1")
    lr.var.set("1e-4")
    batch.var.set("2")
    assert batch.message == "" and batch.error_label.winfo_manager() == ""
    # Fixing the last problem takes the "Cannot start" list away.
    assert app.run_view.error_text() == ""
    assert batch.tooltip.text == plain_text(field_doc("training.batch_size"))  # tooltips come from the docstrings


@pytest.mark.slow
def test_nccl_without_a_gpu_is_refused_by_start_and_named_by_check_setup(window):
    """Backend nccl on a machine without GPUs: Start names the problem instead of launching a run that fails,
    and the "Check setup" button runs scripts/check_multi_gpu.py on the config as edited and shows its report.
    (The script's clean report for the demo: tests/unit/test_check_multi_gpu.py.)"""
    app, _ = window()  # no GPU
    assert app.load("#demo")
    app.multi_gpu._cpu_chosen("2")
    app.binder.write("multi_gpu.backend", "nccl")
    assert app.run_view.start() is False
    assert "multi_gpu.backend: 'nccl' needs CUDA GPUs" in app.run_view.error_text()
    assert app.controller.state.status == "idle"
    frame = app.multi_gpu
    frame.check_button.invoke()
    assert pump(app, lambda: frame.check_button.cget("text") == "Check setup", timeout=240)
    report = frame.check_output.get("1.0", "end")
    assert "check_multi_gpu.py" in report and "--config-path" in report
    assert "PROBLEM: multi_gpu.backend: 'nccl' needs CUDA GPUs" in report and "Problems found" in report


@pytest.mark.slow
def test_multi_gpu_frame_writes_the_config(window):
    gpus = [GpuInfo(0, "Fake GPU", 81920), GpuInfo(1, "Fake GPU", 81920)]
    app, _ = window(gpus=gpus)
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
    assert frame.launcher.var.get() == "auto"
    frame.launcher.var.set("torchrun")
    assert app.model.cfg.multi_gpu.launcher == "torchrun"
    app.binder.fields["training.gradient_accumulation_steps"].var.set("2")
    assert "global batch 32 (8 x 2 x 2)" in frame.summary.cget("text")
    # The memory line per strategy, estimated off the Tk thread for the chosen GPUs (here the demo model).
    frame.strategy.var.set("fsdp")
    assert app.model.cfg.multi_gpu.strategy == "fsdp"
    deadline = time.monotonic() + patience(180)  # a busy machine: the loop ends as soon as it is done
    while "estimating" in frame.memory.cget("text") and time.monotonic() < deadline:
        app.update()
        time.sleep(0.05)
    text = frame.memory.cget("text")
    # The field that chose it by its tab and label, as the window names fields.
    assert text.startswith("Memory plan for 2 GPU(s) of 80 GiB (card): FSDP, ~") and "(set by Training › Strategy" in text, text
    frame.memory_limit.var.set("24,16")  # Memory per GPU: the plan is made for it
    assert app.model.cfg.multi_gpu.memory_limit_gib == "24,16"
    deadline = time.monotonic() + patience(30)
    while "(limit)" not in frame.memory.cget("text") and time.monotonic() < deadline:
        app.update()
        time.sleep(0.05)
    assert frame.memory.cget("text").startswith("Memory plan for 2 GPU(s) of 16, 24 GiB (limit): FSDP"), frame.memory.cget("text")


@pytest.mark.slow
def test_multi_gpu_frame_without_gpus_offers_cpu_processes(window):
    app, _ = window(gpus=[])
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


def test_a_crashing_run_shows_its_error_and_the_gui_stays_usable(window):
    app, _ = window(controller=CrashingController())
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


@pytest.mark.slow
def test_continue_button_resumes_the_newest_backup(window, tmp_path):
    from modules.trainer.backup import write_backup

    app, _ = window(controller=CrashingController())
    app.binder.fields["general.workspace_dir"].var.set(str(tmp_path / "ws"))
    app.run_view._update_buttons()
    button = app.run_view.continue_button
    assert button.cget("state") == "disabled"  # nothing to continue yet
    backup = write_backup(tmp_path / "ws" / "backups", "run-a", 40, {"w": torch.zeros(1)}, {}, {}, keep=2)
    app.run_view._update_buttons()
    assert button.cget("state") == "normal" and button.cget("text") == "Continue from step 40"
    button.invoke()
    assert app.controller.resumed == str(backup)  # the backup the button names, not whatever is newest then
    assert pump(app, lambda: not app.controller.state.active, timeout=20)
    app.run_view.start_button.invoke()
    assert app.controller.resumed is None  # Start is always a new run


@pytest.mark.slow
def test_demo_on_two_cpu_processes_from_the_gui(window, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    app, _ = window()
    assert app.load("#demo")
    app.binder.fields["general.workspace_dir"].var.set(str(tmp_path / "ws"))
    app.multi_gpu._cpu_chosen("2")
    view = app.run_view
    view.start_button.invoke()
    assert app.controller.state.status == "running", view.error_text()
    command = app.controller.state.command
    assert command[1].endswith("train_multi_gpu.py") and command[-1].endswith("gui-config.json")
    written = json.loads(Path(command[-1]).read_text(encoding="utf-8"))  # the file carries the CPU processes
    assert written["general"]["device"] == "cpu" and written["multi_gpu"]["num_gpus"] == 2
    assert pump(app, lambda: app.controller.state.step >= 1 or not app.controller.state.active, timeout=150), \
        "no progress from the demo run:\n" + "\n".join(app.controller.log)
    assert app.controller.state.status == "running", app.controller.state.error
    assert app.controller.state.run_info.get("world_size") == 2
    assert "Epoch 1/" in view.progress_text.cget("text") and view.progress.get() > 0
    view.stop_button.invoke()
    assert pump(app, lambda: not app.controller.state.active, timeout=90)
    assert app.controller.state.status == "stopped", app.controller.state.error
    assert app.controller.state.step < app.controller.state.total_steps


# --- issue 20: a GUI a person can live in ------------------------------------------------------
SCRIPTED_TRAINER = textwrap.dedent("""
    import json, sys
    def emit(**event):
        print("@tandem " + json.dumps(event), flush=True)
    first, last, sample, code = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    emit(type="config", world_size=2, per_gpu_batch=4, accumulation=1, global_batch=8, steps_per_epoch=10,
         total_steps=10, base_lr=1e-4, lr=2e-4)
    for step in range(first, last + 1):
        emit(type="loss", step=step, loss=1.0 / step, lr=2e-4, rank_losses=[0.9 / step, 1.1 / step])
        emit(type="progress", epoch=1, epochs=1, step=step, total_steps=10, images_per_s=8.0, eta_s=3,
             rank_images_per_s=[4.0, 4.0])
        if step % 2 == 0:
            emit(type="validation", step=step, loss=2.0 / step, images=3)
    if sample != "-":
        emit(type="sample", step=last, path=sample, prompt="a red circle")
    if code:
        print("RuntimeError: scripted failure", flush=True)
    else:
        import time
        time.sleep(float(sys.argv[5]) if len(sys.argv) > 5 else 0)
    sys.exit(code)
""")


class ScriptedController(RunController):
    """Runs the scripted trainer with the arguments of the next `script` entry instead of training."""

    def __init__(self):
        super().__init__()
        self.script: list[list[str]] = []
        self.started: list[list[str]] = []

    def start(self, cfg, visible_gpus, command=None, resume=None):
        from ui.launch_command import build_command, run_config
        self.started.append(build_command(run_config(cfg, visible_gpus), "gui-config.json", visible_gpus, resume=resume))
        return super().start(cfg, visible_gpus, command=[sys.executable, "-c", SCRIPTED_TRAINER, *self.script.pop(0)])


def _png(path: Path) -> Path:
    from PIL import Image
    Image.new("RGB", (64, 64), (200, 30, 30)).save(path)
    return path


@pytest.mark.slow
def test_a_new_run_starts_clean_and_a_resumed_run_continues_the_loss_curve(window, tmp_path):
    controller = ScriptedController()
    app, _ = window(controller=controller)
    view = app.run_view
    controller.script = [["1", "4", str(_png(tmp_path / "s.png")), "1"], ["3", "5", "-", "0", "1"]]
    view.start_button.invoke()
    assert pump(app, lambda: controller.state.status == "failed", timeout=20)
    pump(app)
    assert view.status.cget("text") == "Failed"  # not "Failed - Failed"
    assert view.gallery.showing()[1:] == (4, ["a red circle"]) and view.gallery.cells[0][0].cget("text") == ""
    assert "World size 2" in view.run_info.cget("text") and "step 4/10" in view.progress_text.cget("text")
    assert [s for s, _ in view.loss_plot.points] == [1, 2, 3, 4]
    assert view.loss_plot.validation == [(2, 1.0), (4, 0.5)], "validation events plotted beside the loss"
    assert len(view.loss_plot.find_withtag("validation")) == 3  # the line through them and a dot each

    # Continue from step 2's backup: the resumed run reports step 3 first.
    import torch

    from modules.trainer.backup import write_backup
    backup = write_backup(tmp_path / "ws" / "backups", "run-a", 2, {"w": torch.zeros(1)}, {}, {}, keep=2)
    view._render()  # (a real run writes its backup before it ends, so the end's render finds it)
    assert view.continue_button.cget("text") == "Continue from step 2"
    view.continue_button.invoke()
    assert controller.started[-1][-2:] == ["--resume", str(backup)]
    # Straight after Start nothing of the failed run is left on screen.
    assert view.error_text() == "" and view.status.cget("text") == "Running - starting the training processes"
    assert view.gallery.showing() == (None, None, []) and view.gallery.empty.winfo_manager() == "grid"
    assert view.progress_text.cget("text") == "" and view.run_info.cget("text") == "" and view.progress.get() == 0
    assert view.per_gpu_text() == []
    assert pump(app, lambda: controller.state.step == 5, timeout=20)
    pump(app)
    assert [s for s, _ in view.loss_plot.points] == [1, 2, 3, 4, 5]
    assert view.loss_plot.points[2] == (3, 1.0 / 3)
    # The validation curve continues too: step 2's point from the first run, step 4 scored again.
    assert view.loss_plot.validation == [(2, 1.0), (4, 0.5)]
    assert pump(app, lambda: controller.state.status == "finished", timeout=20)
    pump(app)
    assert view.status.cget("text") == "Finished"


@pytest.mark.slow
def test_per_gpu_view_shows_each_rank_and_its_gpu(window, tmp_path):
    from tests.unit.test_ui_controllers import FakeNvml
    from ui.gpu_info import UsageMonitor
    controller = ScriptedController()
    gpus = [GpuInfo(0, "Fake GPU", 81920), GpuInfo(1, "Fake GPU", 81920), GpuInfo(2, "Fake GPU", 81920)]
    app, _ = window(gpus=gpus, controller=controller)
    view = app.run_view
    view.monitor = UsageMonitor(FakeNvml())
    view._poll_gpus()
    assert view.per_gpu_text()[0] == ["", "Loss", "Images/s", "GPU load", "Memory", "Temp."]
    assert [row[0] for row in view.per_gpu_text()[1:]] == ["GPU 0", "GPU 1", "GPU 2"]  # idle: the GPUs only
    app.multi_gpu.enable.widget.toggle()
    app.multi_gpu.gpu_checks[2].toggle()  # GPU 1 left out: ranks 0 and 1 train on GPUs 0 and 2
    controller.script = [["1", "2", "-", "0", "5"]]
    view.start_button.invoke()
    assert controller.started[-1][1].endswith("train_multi_gpu.py")
    assert pump(app, lambda: controller.state.step == 2, timeout=20)
    pump(app)
    rows = view.per_gpu_text()[1:]
    assert rows[0] == ["Rank 0 · GPU 0", "0.4500", "4.00", "0%", "1.0 / 80 GiB", "50 °C"]
    assert rows[1] == ["Rank 1 · GPU 2", "0.5500", "4.00", "20%", "3.0 / 80 GiB", ""]
    assert rows[2][0] == "GPU 1" and rows[2][1] == ""
    controller.terminate()


@pytest.mark.slow
def test_the_window_works_at_1024x600(window, tmp_path):
    from PIL import ImageGrab

    from ui.views.app import MIN_SIZE
    app, _ = window()
    assert (app._min_width, app._min_height) == MIN_SIZE  # CTk keeps what minsize() was given
    for width, height in ((1024, 600), MIN_SIZE):
        app.geometry(f"{width}x{height}+0+0")
        pump(app, timeout=0.6)
        right = app.winfo_rootx() + app.winfo_width()
        for button in (app.load_button, app.save_button, app.save_as_button):
            assert button.winfo_rootx() + button.winfo_width() <= right, (width, button.cget("text"))
        app.tabs.set("Run")
        view = app.run_view
        view._parent_canvas.yview_moveto(0.0)
        pump(app, timeout=0.3)
        bottom = app.winfo_rooty() + app.winfo_height()
        for button in (view.start_button, view.continue_button, view.stop_button, view.save_button,
                       view.tensorboard_button):
            assert button.winfo_rootx() + button.winfo_width() <= right, (width, button.cget("text"))
            assert button.winfo_rooty() + button.winfo_height() <= bottom
        # The log is below the fold at this height: the tab scrolls down to it.
        view._parent_canvas.yview_moveto(1.0)
        pump(app, timeout=0.3)
        assert view.log.winfo_rooty() + view.log.winfo_height() <= bottom + 2, (width, height)
        assert view.log.winfo_rooty() >= app.winfo_rooty()
    app.geometry("1024x600+0+0")
    pump(app, timeout=0.6)
    shot = ImageGrab.grab(bbox=(app.winfo_rootx(), app.winfo_rooty(), app.winfo_rootx() + app.winfo_width(),
                                app.winfo_rooty() + app.winfo_height()), xdisplay=os.environ["DISPLAY"])
    assert shot.size == (1024, 600)
    shot.save(tmp_path / "run-1024x600.png")


@pytest.mark.slow
def test_tooltips_read_as_text_and_fields_that_do_not_apply_are_disabled(window, tmp_path):
    from ui.views.tooltip import Tooltip
    app, dialogs = window(gpus=[GpuInfo(0, "Fake GPU", 81920), GpuInfo(1, "Fake GPU", 81920)])
    pump(app)
    tips = [t.text for t in list(Tooltip._by_widget().values())]
    assert len(tips) > 80 and all(tips) and not [t for t in tips if "`" in t]
    view, frame = app.run_view, app.multi_gpu
    for widget in (frame.gpu_checks[0], frame.summary, frame.check_button, view.start_button, view.continue_button,
                   view.stop_button,
                   view.sample_button, view.backup_button, view.save_button, view.output_button,
                   view.tensorboard_button):
        assert Tooltip.of(widget) is not None and len(Tooltip.of(widget).text) > 40, widget
    # Every config field has a place in the window, so every message can name a tab and a label.
    from modules.config.field_paths import leaf_paths
    assert [p for p in leaf_paths(app.model.cfg) if app.binder.places.name(p) is None] == []
    fields = app.binder.fields
    # An edit model's pairs: the Control... button stores a folder inside the concept's own as a relative one, and
    # the line under the concepts counts the pairs.
    for stem in ("a", "b", "c"):
        for folder in (tmp_path / "pairs", tmp_path / "pairs" / "before"):
            folder.mkdir(exist_ok=True)
            Image.new("RGB", (8, 8)).save(folder / f"{stem}.png")
    (tmp_path / "pairs" / "before" / "c.png").unlink()
    fields["data.concepts[0].path"].var.set(str(tmp_path / "pairs"))
    fields["model.model_type"].var.set("qwen_edit")
    dialogs.chosen_path = str(tmp_path / "pairs" / "before")
    app.concepts.choose(0, "control")
    assert fields["data.concepts[0].control"].var.get() == "before"
    pump(app)
    assert "2 pairs, 1 without a control image" in app.concepts.pairs_line.cget("text")
    assert fields["sampling.prompts[0].control"].widget.cget("state") == "normal"
    fields["model.model_type"].var.set("flux")
    assert fields["sampling.prompts[0].control"].widget.cget("state") == "disabled"  # Flux.1 takes none
    # ... and its concept rows leave the Control column out (the row fits the window: test_ui_first_use).
    headers = [label.cget("text") for label in app.concepts.header_labels]
    assert "data.concepts[0].control" not in fields and "Control" not in headers
    fields["model.model_type"].var.set("qwen_edit")
    assert "data.concepts[0].control" in fields
    method, optimizer = fields["training.method"], fields["optimizer.name"]
    method.var.set("lora")
    assert fields["training.lora_rank"].widget.cget("state") == "normal"
    assert fields["optimizer.momentum"].widget.cget("state") == "disabled"  # AdamW has no momentum
    assert "Not used now: used only by SGD" in fields["optimizer.momentum"].tooltip.text
    method.var.set("full")
    optimizer.var.set("sgd")
    for path in ("training.lora_rank", "training.lora_alpha", "training.lora_dropout", "training.lora_target_modules",
                 "save.lora_format", "optimizer.beta1", "optimizer.fused"):
        assert fields[path].widget.cget("state") == "disabled", path
    assert fields["optimizer.momentum"].widget.cget("state") == "normal"
    assert fields["save.full_format"].widget.cget("state") == "normal"
    assert "Method is full" in fields["training.lora_rank"].tooltip.text
    method.var.set("lora")
    assert fields["training.lora_rank"].widget.cget("state") == "normal"
    optimizer.var.set("prodigy")
    assert fields["optimizer.prodigy_d_coef"].widget.cget("state") == "normal"
    assert fields["optimizer.schedule_free_r"].widget.cget("state") == "disabled"
    assert "used only by schedule-free AdamW" in fields["optimizer.schedule_free_r"].tooltip.text
    assert "Prodigy" in fields["optimizer.prodigy_d_coef"].tooltip.text
    optimizer.var.set("adamw_schedule_free")
    assert fields["optimizer.schedule_free_r"].widget.cget("state") == "normal"
    assert fields["optimizer.prodigy_d_coef"].widget.cget("state") == "disabled"


@pytest.mark.slow
def test_open_output_folder_and_tensorboard_say_where_in_the_window(window, tmp_path, monkeypatch):
    from ui import external
    from modules.config.run_paths import RunPaths
    app, _ = window()
    view = app.run_view
    monkeypatch.setattr(external.sys, "platform", "linux")
    monkeypatch.setattr(external.shutil, "which", lambda name: None)
    view.output_button.invoke()  # no file manager here: no traceback, the path in the window
    folder = str(RunPaths(app.model.cfg).output_dir.resolve())
    assert pump(app, lambda: "No file manager found" in view.notice_text(), timeout=10)
    assert folder in view.notice_text()

    class Server:
        def __init__(self, command, **kwargs):
            pass

        def poll(self):
            return None

        def terminate(self):
            pass

    monkeypatch.setattr(external.subprocess, "Popen", Server)
    view.tensorboard.answers = lambda port: True
    view.tensorboard.open_browser = lambda url: "no web browser was found"
    view.tensorboard_button.invoke()
    assert pump(app, lambda: "no web browser" in view.notice_text(), timeout=10)
    assert view.tensorboard.url in view.notice_text()


@pytest.mark.slow
def test_multi_gpu_start_without_gpus_is_refused_and_with_one_gpu_asked(window):
    controller = ScriptedController()
    app, dialogs = window(controller=controller)
    app.multi_gpu.enable.widget.toggle()
    assert app.model.cfg.multi_gpu.enabled and app.multi_gpu.cpu_var.get() == "off"
    assert app.run_view.start() is False
    assert "no GPU is visible" in app.run_view.error_text() and "CPU processes" in app.run_view.error_text()
    assert controller.state.status == "idle" and controller.started == []

    app._gpus_found([GpuInfo(0, "Fake GPU", 81920)])
    dialogs.yes_no_answer = False
    assert app.run_view.start() is False and "one GPU" in dialogs.questions[-1]
    assert controller.started == []
    dialogs.yes_no_answer = True
    controller.script = [["1", "1", "-", "0"]]
    assert app.run_view.start() is True
    assert controller.started[-1][1].endswith("train.py")
    assert pump(app, lambda: not controller.state.active, timeout=20)
    written = json.loads((controller.run_host.commands_file.parent / "gui-config.json").read_text(encoding="utf-8"))
    assert written["multi_gpu"]["enabled"] is False  # the run's config says what ran
    assert app.model.cfg.multi_gpu.enabled  # and the edited one is as the user left it


def _shown(app, path: str) -> bool:
    field = app.binder.fields[path]
    return field.visible and all(widget.winfo_manager() == "grid" for widget in field.row_widgets)


@pytest.mark.slow
def test_model_family_rows_appear_and_disappear_with_the_model_type(window):
    """A family's own settings show only when they apply (ui/field_visibility.py)."""
    app, _ = window()
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
    app.binder.fields["model.model_type"].var.set("flux2")  # a language model instead of T5, guidance on dev
    pump(app)
    assert _shown(app, "model.text_max_length") and not _shown(app, "model.t5_max_length")
    assert _shown(app, "training.flux_guidance")
    app.binder.fields["model.model_type"].var.set("chroma")  # T5, no guidance input
    pump(app)
    assert _shown(app, "model.t5_max_length") and not _shown(app, "model.text_max_length")
    assert not _shown(app, "training.flux_guidance") and not _shown(app, "data.video_frames")
    app.binder.fields["model.model_type"].var.set("wan")  # video: the clip window's frames and rate
    pump(app)
    assert _shown(app, "data.video_frames") and _shown(app, "data.video_fps") and _shown(app, "model.t5_max_length")
    assert not _shown(app, "training.flux_guidance")
    app.binder.fields["model.base_model"].var.set("builtin:demo")
    app.binder.fields["model.model_type"].var.set("auto")
    pump(app)
    assert _shown(app, "model.prediction_type") and not _shown(app, "training.timestep_logit_mean")


@pytest.mark.slow
def test_concept_rows_offer_roles_masks_and_weights_with_tooltips(window):
    app, _ = window()
    binder = app.binder
    role = binder.fields["data.concepts[0].role"]
    assert role.widget.cget("values") == ["train", "regularisation", "validation"]
    role.var.set("validation")
    pump(app)
    assert app.binder.model.cfg.data.concepts[0].role == "validation"
    # No training concept left: the list says so; the cadence field needs a validation set, which there is now.
    assert any("no enabled concept has role 'train'" in p for p in binder.problems.get("data.concepts", []))
    role.var.set("train")
    binder.fields["data.concepts[0].masks"].widget.toggle()
    binder.fields["data.concepts[0].unmasked_weight"].var.set("0.1")
    binder.fields["data.concepts[0].loss_weight"].var.set("0.5")
    pump(app)
    concept = app.binder.model.cfg.data.concepts[0]
    assert (concept.masks, concept.unmasked_weight, concept.loss_weight) == (True, 0.1, 0.5)
    assert "-masklabel.png" in plain_text(field_doc("data.concepts[0].masks"))
    assert "prior" in plain_text(field_doc("data.concepts[0].role"))
    cadence = binder.fields["training.validation_every_n_steps"]
    assert cadence.widget.cget("state") == "disabled", "no validation set: the cadence does nothing"
    binder.fields["data.validation_fraction"].var.set("0.1")
    pump(app)
    assert cadence.widget.cget("state") == "normal"


@pytest.mark.slow
def test_multi_gpu_frame_sets_restarts_and_several_machines(window):
    """#17: the frame's restart and machine fields write the config; the line under them says what they do,
    and the summary counts the processes of every machine."""
    gpus = [GpuInfo(0, "Fake GPU", 81920), GpuInfo(1, "Fake GPU", 81920)]
    app, _ = window(gpus=gpus)
    frame = app.multi_gpu
    app.binder.fields["training.batch_size"].var.set("8")
    frame.enable.widget.toggle()
    assert frame.nodes_hint.cget("text") == ""
    for path, value in (("multi_gpu.max_restarts", "3"), ("multi_gpu.nnodes", "2"), ("multi_gpu.node_rank", "1"),
                        ("multi_gpu.master_port", "29500")):
        app.binder.fields[path].var.set(value)
    m = app.model.cfg.multi_gpu
    assert (m.max_restarts, m.nnodes, m.node_rank) == (3, 2, 1)
    hint = frame.nodes_hint.cget("text")
    assert "This machine is node 1 of 2" in hint and "127.0.0.1:29500" in hint
    assert "restart up to 3 time(s)" in hint and "written every 10 minutes" in hint
    assert frame.summary.cget("text").startswith("World size 4 · global batch 32 (8 x 1 x 4)")
