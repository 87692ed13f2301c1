"""The GUI as a first-time user meets it: several runs in one window, states that follow the config, errors
that reach the window. Views under Xvfb, driven through their variables and `.invoke()`."""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest

from ui.run_controller import RunController
from ui.settings import RecentConfigs

from tests.test_ui_widgets import ScriptedController, _png, app_factory, pump  # noqa: F401 - fixture

__all__ = ["app_factory"]

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


def _run_to_the_end(app, controller, script: list[str]) -> None:
    controller.script = [script]
    app.run_view.start_button.invoke()
    assert controller.state.status == "running", app.run_view.error_text()
    assert pump(app, lambda: not controller.state.active, timeout=30), "the scripted run did not end"
    pump(app)


def test_three_starts_in_one_window_each_show_their_sample(app_factory, tmp_path):
    """Start did nothing from the third run on: the sample label kept the previous run's deleted image
    (`image "pyimage4" doesn't exist`), so clearing it for the next run raised before anything started."""
    controller = ScriptedController()
    app, _ = app_factory(controller=controller)
    view = app.run_view
    for run in range(3):
        folder = tmp_path / "ws" / "samples" / f"run-{run}"
        folder.mkdir(parents=True)
        sample = _png(folder / "step-0000002-0.png")
        _run_to_the_end(app, controller, ["1", "2", str(sample), "0"])
        assert controller.state.status == "finished", view.error_text()
        assert view.gallery.showing() == (f"run-{run}", 2, ["a red circle"]), f"run {run + 1}: its sample is not shown"
        assert view.gallery.cells[0][0].cget("text") == ""  # the picture, not a message
    assert len(controller.started) == 3
    # Every run's samples are still there to look at.
    assert view.gallery.run_menu.cget("values") == ["run-2", "run-1", "run-0"]
    view.gallery.choose_run("run-0")
    assert view.gallery.showing() == ("run-0", 2, ["a red circle"])


def test_an_exception_in_a_tk_callback_reaches_the_window(app_factory):
    """Tk prints a callback's exception on the terminal and goes on; a window user saw nothing happen."""
    app, _ = app_factory()

    def broken() -> None:
        raise RuntimeError("something inside the window broke")

    app.after(0, broken)
    assert pump(app, lambda: "something inside the window broke" in app.crash_text(), timeout=5)
    assert "RuntimeError" in app.crash_text() and "broken" in app.crash_text()  # the traceback, for a report
    app.crash_dismiss.invoke()
    assert app.crash_text() == ""


def _backup(workspace: Path, run: str, step: int) -> Path:
    import torch

    from modules.trainer.backup import write_backup
    return write_backup(workspace / "backups", run, step, {"w": torch.zeros(1)}, {}, {}, keep=3)


def test_continue_follows_the_workspace_and_the_preset(app_factory, tmp_path, monkeypatch):
    """Continue kept offering "Continue from step 100" after switching to an empty workspace or another
    preset, and clicking it failed with the command line's wording (`--resume latest: ...`)."""
    import shutil

    monkeypatch.chdir(tmp_path)  # the presets' relative workspaces are empty here
    controller = ScriptedController()
    app, _ = app_factory(controller=controller)
    view, workspace = app.run_view, app.binder.fields["general.workspace_dir"]
    backup = _backup(tmp_path / "ws2", "run-a", 100)
    workspace.var.set(str(tmp_path / "ws2"))
    assert view.continue_button.cget("text") == "Continue from step 100"
    workspace.var.set(str(tmp_path / "empty"))
    assert view.continue_button.cget("state") == "disabled"
    assert view.continue_button.cget("text") == "Continue from backup"
    workspace.var.set(str(tmp_path / "ws2"))
    assert view.continue_button.cget("state") == "normal"
    assert app.load("sd15_lora")
    assert view.continue_button.cget("state") == "disabled"
    assert app.load("#demo")
    workspace.var.set(str(tmp_path / "ws2"))
    assert view.continue_button.cget("state") == "normal"
    # The backup goes behind the window's back: the click says so in the window's words and starts nothing.
    shutil.rmtree(backup)
    view.continue_button.invoke()
    assert controller.started == [] and controller.state.status == "idle"
    assert "no backup to continue" in view.error_text().lower() and "--resume" not in view.error_text()
    assert view.continue_button.cget("state") == "disabled"
    # Continue resumes the very backup its button names, whatever is written later.
    backup = _backup(tmp_path / "ws2", "run-b", 40)
    view._update_buttons()
    controller.script = [["41", "42", "-", "0"]]
    view.continue_button.invoke()
    assert controller.started[-1][-2:] == ["--resume", str(backup)]
    assert pump(app, lambda: not controller.state.active, timeout=30)


def test_continue_is_not_offered_for_a_finished_run(app_factory, tmp_path):
    """After a finished run Continue was offered: it trained 0 images, wrote another copy of the model and
    cleared the plot. A stopped run's backup is offered; one written after its run finished and was resumed
    again (more epochs) too."""
    import time

    from modules.trainer.backup import mark_finished
    app, _ = app_factory(controller=ScriptedController())
    view, workspace = app.run_view, app.binder.fields["general.workspace_dir"]
    backups = tmp_path / "finished" / "backups"
    _backup(tmp_path / "finished", "run-a", 50)
    _backup(tmp_path / "finished", "run-a", 100)
    time.sleep(0.01)
    mark_finished(backups, "run-a", 100, tmp_path / "out.safetensors")
    workspace.var.set(str(tmp_path / "finished"))
    assert view.continue_button.cget("state") == "disabled"
    assert view.continue_button.cget("text") == "Continue from backup"
    _backup(tmp_path / "finished", "run-a", 130)  # the finished run, resumed with more epochs and stopped
    view._update_buttons()
    assert view.continue_button.cget("text") == "Continue from step 130"


def test_the_status_line_drops_a_save_once_it_is_done(app_factory):
    """After "Save now" the status said "Running - saving demo-step0000029" for the rest of the run."""
    controller = PlayedController()
    app, _ = app_factory(controller=controller)
    view = app.run_view
    progress = {"type": "progress", "epoch": 1, "epochs": 1, "step": 3, "total_steps": 9, "images_per_s": 2.0}
    controller.runs = [([{"type": "status", "text": "saving demo-step0000002.safetensors"},
                         {"type": "saved", "path": "out/demo-step0000002.safetensors", "step": 2}, progress, 30], 0)]
    view.start_button.invoke()
    assert pump(app, lambda: controller.state.step == 3, timeout=20)
    pump(app)
    assert view.status.cget("text") == "Running"
    controller.terminate()


def test_a_restart_note_outlasts_the_steps_after_it():
    from ui.events import TrainingEvent
    controller = RunController()
    controller.state.status = "running"
    note = "restart 1 of 3: rank 1 died (SIGKILL) at step 431; resuming from the backup at step 400"
    controller._apply(TrainingEvent("restart", {"text": note}))
    controller._apply(TrainingEvent("progress", {"step": 401, "total_steps": 900}))
    assert controller.state.headline == "Running - " + note


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_open_buttons_say_when_nothing_opened(app_factory, tmp_path, monkeypatch):
    """"Open output folder" and "Open TensorBoard" said they had opened something when nothing had: the
    opener's exit status was not read, nor whether TensorBoard came up."""
    from modules.config.run_paths import RunPaths
    from ui import external
    opener = _script(tmp_path / "xdg-open", "#!/bin/sh\necho 'xdg-open: no method available for opening' >&2\nexit 3\n")
    monkeypatch.setattr(external.sys, "platform", "linux")
    monkeypatch.setattr(external.shutil, "which", lambda name: str(opener) if name == "xdg-open" else None)
    app, _ = app_factory()
    view = app.run_view
    view.output_button.invoke()
    assert pump(app, lambda: "Could not open" in view.notice_text(), timeout=20), view.notice_text()
    assert "no method available for opening" in view.notice_text()
    assert str(RunPaths(app.model.cfg).output_dir.resolve()) in view.notice_text()

    view.tensorboard.python = str(_script(tmp_path / "python-without-tensorboard",
                                          "#!/bin/sh\necho 'No module named tensorboard' >&2\nexit 1\n"))
    view.tensorboard_button.invoke()
    assert pump(app, lambda: "could not start" in view.notice_text(), timeout=20), view.notice_text()
    assert "No module named tensorboard" in view.notice_text()

    # A server that answers, and a browser that does not open.
    view.tensorboard.python = str(_script(tmp_path / "python-serving", f"#!{sys.executable}\n" + (
        "import socket, sys, time\n"
        "server = socket.socket()\n"
        "server.bind(('127.0.0.1', int(sys.argv[sys.argv.index('--port') + 1])))\n"
        "server.listen()\n"
        "time.sleep(120)\n")))
    try:
        view.tensorboard_button.invoke()
        assert pump(app, lambda: "browser did not open" in view.notice_text(), timeout=30), view.notice_text()
        assert view.tensorboard.url in view.notice_text() and "no method available" in view.notice_text()
    finally:
        view.tensorboard.close()


def test_a_concept_row_wider_than_the_window_scrolls_sideways(app_factory):
    """At 1024 px the Data tab's concept row was wider than the window and its Remove button out of reach."""
    app, _ = app_factory()
    app.geometry("1024x600+0+0")
    app.tabs.set("Data")
    pump(app, timeout=0.8)
    editor = app.concepts
    remove = editor.rows[0][-1]
    assert remove.cget("text") == "Remove"
    window_right = app.winfo_rootx() + app.winfo_width()
    assert editor.scroller.visible_right_edge() <= window_right
    assert remove.winfo_rootx() + remove.winfo_width() > editor.scroller.visible_right_edge(), \
        "the row fits at 1024 px: this test no longer shows the scrolling"
    assert editor.scroller.scrollbar.winfo_manager() == "grid"
    editor.scroller.canvas.xview_moveto(1.0)
    pump(app, timeout=0.5)
    assert remove.winfo_rootx() + remove.winfo_width() <= editor.scroller.visible_right_edge() + 1
    assert remove.winfo_rootx() >= app.winfo_rootx()
    remove.invoke()
    assert app.model.cfg.data.concepts == []
    # In the default window the row fits and no scroll bar shows.
    app.concepts.add(__import__("modules.config", fromlist=["ConceptConfig"]).ConceptConfig(path="x"))
    app.geometry("1100x820+0+0")
    pump(app, timeout=0.8)
    assert editor.scroller.scrollbar.winfo_manager() == ""


def test_quit_during_training_asks_first_and_never_freezes(app_factory):
    """Quit during training froze the window ~20 s (it waited on the Tk thread), then asked "Save the
    changes?" - and Cancel kept the window although training had already been stopped."""
    import time
    controller = PlayedController()
    controller.stop_timeout_s = 1.0  # the played run ignores stop: it is ended after this
    app, dialogs = app_factory(controller=controller)
    app.binder.fields["training.epochs"].var.set("7")  # an unsaved change
    controller.runs = [([{"type": "progress", "epoch": 1, "epochs": 1, "step": 1, "total_steps": 9}, 60], 0)]
    app.run_view.start_button.invoke()
    assert pump(app, lambda: controller.state.step == 1, timeout=20)
    dialogs.save_answer = None  # Cancel at "Save the changes?"
    app.close()
    assert controller.state.status == "running" and not app.closed, "Cancel must change nothing"
    assert dialogs.questions == []  # not asked to stop before the save question was answered
    dialogs.save_answer = False  # Don't save
    dialogs.yes_no_answer = True  # Stop training and quit
    began = time.monotonic()
    app.close()
    assert time.monotonic() - began < 1.0, "close() waited for training on the Tk thread"
    assert controller.state.status == "stopping" and "closing" in app.title().lower()
    deadline = time.monotonic() + 30
    while not app.closed and time.monotonic() < deadline:
        app.update()
        time.sleep(0.02)
    assert app.closed and not controller.state.active


def test_an_ended_run_shows_the_rate_of_the_whole_run(app_factory):
    """A run stopped at step 2 showed "797.55 images/s" (real rate 0.5): the last report's step rate."""
    controller = PlayedController()
    app, _ = app_factory(controller=controller)
    view = app.run_view
    controller.runs = [([{"type": "progress", "epoch": 1, "epochs": 1, "step": 2, "total_steps": 100,
                          "images_per_s": 797.55, "eta_s": 0.1},
                         {"type": "done", "output": None, "step": 2, "completed": False, "images": 2,
                          "train_s": 4.0, "images_per_s": 0.5}], 0)]
    view.start_button.invoke()
    assert pump(app, lambda: controller.state.status == "finished", timeout=20)
    pump(app)
    assert "0.50 images/s over the whole run" in view.progress_text.cget("text")
    assert "797" not in view.progress_text.cget("text")


def test_save_warns_about_problems_and_unread_text_counts_as_unsaved(app_factory, tmp_path):
    """Save wrote "batch_size": -2 without a word, and text that could not be read ("fast" as a learning
    rate) did not set the unsaved marker, so closing lost it silently."""
    from modules.config import read_json
    app, dialogs = app_factory()
    target = tmp_path / "mine.json"
    assert app.save_as(str(target)) and not app.title().endswith("*")
    saved_lr = app.binder.fields["training.learning_rate"].var.get()
    app.binder.fields["training.learning_rate"].var.set("fast")
    assert app.title().endswith("*"), "text the field could not take is an unsaved change"
    app.binder.fields["training.learning_rate"].var.set(saved_lr)  # back to what the file holds
    assert not app.title().endswith("*")
    app.binder.fields["training.learning_rate"].var.set("fast")
    app.binder.fields["training.batch_size"].var.set("-2")
    dialogs.yes_no_answer = False
    assert app.save() is False
    asked = dialogs.questions[-1]
    assert "Training › Batch size per GPU" in asked and "Training › Learning rate" in asked and "fast" in asked
    assert read_json(target)["training"].get("batch_size", 1) != -2
    dialogs.yes_no_answer = True  # saved as it is, when the user says so
    assert app.save() is True and read_json(target)["training"]["batch_size"] == -2
    # The field shows what the file holds now, as the question said it would.
    assert app.binder.fields["training.learning_rate"].var.get() == saved_lr and not app.title().endswith("*")
    app.binder.fields["training.learning_rate"].var.set("fast")
    dialogs.save_answer = None
    app.close()
    assert not app.closed, "closing asks about the text that is not saved"


def test_multi_gpu_wording_says_what_is_true_for_this_setup(app_factory):
    """'0 GPU visible'; 'node 0 listens on 127.0.0.1:a fixed port.' with no word that 127.0.0.1 is out of reach
    of another machine; a GUI user told to pass --master-port; 'backups every 10 minutes unless a backup
    cadence is set' beside an epoch cadence; CPU processes called GPU 0/GPU 1; the batch split's own example
    invalid with the demo's defaults; 'every rank stops' in a one-process run."""
    from ui.binding import field_label
    from ui.gpu_info import GpuInfo
    from modules.util.batch_slice import parse_split
    controller = PlayedController()
    app, _ = app_factory(controller=controller)
    frame, fields = app.multi_gpu, app.binder.fields
    assert frame.explanation.cget("text").startswith("No GPU visible")
    app._gpus_found([GpuInfo(0, "Fake GPU", 81920)])
    assert frame.explanation.cget("text").startswith("1 GPU visible")
    app._gpus_found([GpuInfo(0, "Fake GPU", 81920), GpuInfo(1, "Fake GPU", 81920)])
    gc.collect()  # the replaced check boxes' Tk variables, here on the Tk thread (the window finds GPUs once)
    frame.enable.widget.toggle()
    fields["multi_gpu.nnodes"].var.set("2")
    hint = frame.nodes_hint.cget("text")
    assert "a fixed port" not in hint and "127.0.0.1" in hint and "only this machine" in hint
    problems = "\n".join(app.binder.all_problems(check_paths=False))
    assert "Training › Port" in problems and "--master-port" not in problems
    fields["multi_gpu.master_port"].var.set("29500")
    fields["multi_gpu.master_addr"].var.set("10.0.0.5")
    hint = frame.nodes_hint.cget("text")
    assert "10.0.0.5:29500" in hint and "only this machine" not in hint
    fields["multi_gpu.nnodes"].var.set("1")
    fields["multi_gpu.max_restarts"].var.set("2")
    fields["save.backup_every_n_epochs"].var.set("1")
    hint = frame.nodes_hint.cget("text")
    assert "unless a backup cadence is set" not in hint and "also written every 10 minutes" in hint
    fields["save.backup_every_n_steps"].var.set("50")
    assert "10 minutes" not in frame.nodes_hint.cget("text")
    fields["multi_gpu.max_restarts"].var.set("0")

    app._gpus_found([])
    gc.collect()
    frame._cpu_chosen("2")
    fields["training.batch_size"].var.set("2")
    fields["multi_gpu.batch_split"].var.set("3,1")
    summary = frame.summary.cget("text")
    assert "process 0" in summary and "GPU" not in summary, summary
    # The field's own example is right for what it says it is for.
    assert "6,2" not in field_label("multi_gpu.batch_split")
    assert parse_split("6,2", 2, 4) == [6, 2] and "batch size per GPU of 4 on 2 GPUs" in \
        fields["multi_gpu.batch_split"].tooltip.text.replace("Batch size per GPU", "batch size per GPU")

    frame._cpu_chosen("off")
    frame.enable.widget.toggle()
    controller.runs = [([{"type": "progress", "epoch": 1, "epochs": 1, "step": 1, "total_steps": 9}, 60], 0)]
    app.run_view.start_button.invoke()
    assert pump(app, lambda: controller.state.step == 1, timeout=20)
    app.run_view.stop_button.invoke()
    pump(app)
    assert app.run_view.status.cget("text") == "Stopping - training stops after the current step"
    controller.terminate()


def test_multi_gpu_off_disables_its_controls_and_gives_the_device_back(app_factory):
    """With Multi-GPU off, CPU processes, Launcher and the batch split stayed enabled; choosing CPU processes
    set General › Device to cpu without a word, and it stayed so after Multi-GPU was turned off."""
    app, _ = app_factory()
    frame, fields = app.multi_gpu, app.binder.fields
    assert not app.model.cfg.multi_gpu.enabled
    for widget in (frame.cpu_menu, fields["multi_gpu.launcher"].widget, fields["multi_gpu.batch_split"].widget):
        assert widget.cget("state") == "disabled"
    frame.enable.widget.toggle()
    for widget in (frame.cpu_menu, fields["multi_gpu.launcher"].widget, fields["multi_gpu.batch_split"].widget):
        assert widget.cget("state") == "normal"
    assert fields["general.device"].var.get() == "auto"
    frame._cpu_chosen("2")
    assert fields["general.device"].var.get() == "cpu" and "General › Device" in frame.explanation.cget("text")
    frame.enable.widget.toggle()  # Multi-GPU off
    assert fields["general.device"].var.get() == "auto" and frame.cpu_var.get() == "off"
    assert frame.cpu_menu.cget("state") == "disabled"
    # A device the user chose stays what it was.
    fields["general.device"].var.set("cpu")
    frame.enable.widget.toggle()
    frame._cpu_chosen("3")
    frame.enable.widget.toggle()
    assert fields["general.device"].var.get() == "cpu"
    # Loading a one-process CPU config leaves its device alone.
    fields["general.device"].var.set("auto")
    frame.enable.widget.toggle()
    frame._cpu_chosen("2")
    cfg = __import__("copy").deepcopy(app.model.cfg)
    cfg.multi_gpu.enabled, cfg.general.device = False, "cpu"
    app.model.replace(cfg, None, "cpu-only")
    assert fields["general.device"].var.get() == "cpu"


def test_labels_are_in_one_style(app_factory):
    """"Lora format", "Ema weights", "Unet dtype", "Eps" beside "LoRA rank": a label made from a field's name
    keeps the usual spelling of the words in it."""
    import re
    app, _ = app_factory()
    labels = {path: label for path, (_tab, label) in app.binder.places.places.items()}
    wrong = re.compile(r"\b(Lora|Ema|Unet|Vae|Eps|Lr|Gpu|Gpus|Ddp|Fsdp|Snr|Tf32|Cpu|Mb)\b")
    assert [f"{p}: {label}" for p, label in labels.items() if wrong.search(label)] == []
    assert labels["save.lora_format"] == "LoRA format" and labels["model.unet_dtype"] == "UNet dtype"
    assert labels["optimizer.eps"] == "Epsilon"


def _every_tooltip(app) -> list[str]:
    from ui.views.tooltip import Tooltip
    pump(app)
    return sorted({t.text for t in Tooltip._by_widget().values()})


def test_tooltips_and_messages_speak_to_a_window_user(app_factory):
    """Tooltips and errors showed config paths and names (`nnodes`, `timeout_minutes`), command-line flags
    (`--assume-free-gib`, `--node-rank 1`) and the history of development (a session number with a docs path)."""
    import re

    from modules.config import TrainConfig
    from modules.config.field_paths import leaf_paths
    from ui.gpu_info import GpuInfo
    app, _ = app_factory(gpus=[GpuInfo(0, "Fake GPU", 81920), GpuInfo(1, "Fake GPU", 81920)])
    names = {path.rsplit(".", 1)[-1] for path in leaf_paths(TrainConfig())}
    names = {re.sub(r"\[\d+\]", "", n) for n in names if "_" in n} | {"nnodes"}
    flag = re.compile(r"(?<![\w-])--[a-z][a-z-]+")
    history = re.compile(r"\b(session|round) \d+|docs/|\.md\b")
    path = re.compile(r"\b(general|model|data|training|optimizer|sampling|save|multi_gpu)\.[a-z_]+")
    found = []
    for text in _every_tooltip(app):
        for pattern in (flag, history, path):
            found += [f"{m.group(0)!r} in: {text[:90]}" for m in pattern.finditer(text)]
        found += [f"{name!r} in: {text[:90]}" for name in names if re.search(rf"\b{name}\b", text)]
    assert found == [], "\n".join(found)


def test_the_log_shows_each_line_once_in_words(app_factory):
    """The log repeated each human line as a raw event dump: `[backup] path=..., paused_s=0.077`."""
    controller = PlayedController()
    app, _ = app_factory(controller=controller)
    controller.runs = [(["Backup written: ws/backups/run-a/step-00000002 (training paused 0.08 s for it)",
                         {"type": "backup", "path": "ws/backups/run-a/step-00000002", "step": 2, "paused_s": 0.077},
                         "Model saved: ws/output/demo.safetensors",
                         {"type": "saved", "path": "ws/output/demo.safetensors", "step": 2}], 0)]
    app.run_view.start_button.invoke()
    assert pump(app, lambda: not controller.state.active, timeout=20)
    pump(app)
    shown = app.run_view.log.get("1.0", "end")
    log = "\n".join(list(controller.log)[1:])  # after the command line (which holds the played events)
    assert log in shown
    assert "Backup written: ws/backups/run-a/step-00000002" in log and "Model saved" in log
    assert "[backup]" not in log and "paused_s" not in log and "[saved]" not in log
    assert controller.state.backups == ["ws/backups/run-a/step-00000002"]  # the events still count


def test_disabled_buttons_look_disabled(app_factory):
    """Disabled buttons kept their colour: a disabled red Stop looked ready to click."""
    from ui.views.buttons import DISABLED_COLOR
    controller = PlayedController()
    app, _ = app_factory(controller=controller)
    view = app.run_view
    assert view.stop_button.cget("state") == "disabled" and view.stop_button.cget("fg_color") == DISABLED_COLOR
    assert view.start_button.cget("fg_color") == "#2f8f46"
    controller.runs = [([{"type": "progress", "epoch": 1, "epochs": 1, "step": 1, "total_steps": 9}, 60], 0)]
    view.start_button.invoke()
    assert pump(app, lambda: controller.state.step == 1, timeout=20)
    assert view.start_button.cget("fg_color") == DISABLED_COLOR and view.stop_button.cget("fg_color") == "#b03a3a"
    controller.terminate()
    assert pump(app, lambda: not controller.state.active, timeout=20)
    pump(app)
    assert view.start_button.cget("fg_color") == "#2f8f46"


def test_the_wheel_over_the_log_scrolls_the_page_once_the_log_is_at_its_end(app_factory):
    """The mouse wheel over the log scrolled only the box: with the pointer there, the page did not move."""
    app, _ = app_factory()
    app.geometry("1024x600+0+0")
    app.tabs.set("Run")
    view = app.run_view
    page, text = view._parent_canvas, view.log._textbox
    view.log.insert("end", "\n".join(f"line {i}" for i in range(200)))
    view.log.see("1.0")
    page.yview_moveto(0.0)
    pump(app, timeout=0.5)
    text.event_generate("<Button-5>")  # the log can go down: it does, the page stays
    pump(app, timeout=0.2)
    assert page.yview()[0] == 0.0 and text.yview()[0] > 0.0
    view.log.see("end")
    pump(app, timeout=0.2)
    text.event_generate("<Button-5>")  # at the log's end: the page goes down
    pump(app, timeout=0.2)
    assert page.yview()[0] > 0.0
    view.log.delete("1.0", "end")  # nothing to scroll in the log: the page moves either way
    pump(app, timeout=0.2)
    before = page.yview()[0]
    text.event_generate("<Button-4>")
    pump(app, timeout=0.2)
    assert page.yview()[0] < before


def test_ctrl_a_selects_a_whole_field(app_factory):
    app, _ = app_factory()
    app.tabs.set("Training")
    entry = app.binder.fields["training.learning_rate"].widget._entry
    entry.focus_force()
    entry.icursor(2)
    pump(app, timeout=0.3)
    entry.event_generate("<Control-a>")
    pump(app, timeout=0.2)
    assert entry.selection_present() and entry.index("sel.first") == 0 and entry.index("sel.last") == len(entry.get())
    log = app.run_view.log
    log.insert("end", "one\ntwo")
    app.tabs.set("Run")
    log._textbox.focus_force()
    pump(app, timeout=0.3)
    log._textbox.event_generate("<Control-a>")
    assert log._textbox.get("sel.first", "sel.last") == "one\ntwo"


def test_file_dialogs_open_where_the_field_points_and_cancel_is_final(app_factory, tmp_path, monkeypatch):
    """File dialogs opened in the program's folder, and Browse > Cancel on the base model opened a second
    (folder) dialog."""
    monkeypatch.chdir(tmp_path)
    models = tmp_path / "models"
    models.mkdir()
    (models / "sd15.safetensors").write_bytes(b"")
    app, dialogs = app_factory()
    base = app.binder.fields["model.base_model"]
    assert set(base.browse_buttons) == {"file", "folder"}
    base.var.set(str(models / "sd15.safetensors"))
    base.browse_buttons["file"].invoke()  # Cancel
    assert dialogs.file_dialogs == [("file", str(models))] and base.var.get() == str(models / "sd15.safetensors")
    dialogs.chosen_path = str(tmp_path / "other")
    base.browse_buttons["folder"].invoke()
    assert dialogs.file_dialogs[-1] == ("folder", str(models)) and base.var.get() == str(tmp_path / "other")
    # A placeholder nothing of which exists, builtin: and an empty field open in the home folder.
    home = str(Path.home())
    for value in ("missing/model.safetensors", "builtin:demo", ""):
        base.var.set(value)
        base.browse_buttons["file"].invoke()
        assert dialogs.file_dialogs[-1] == ("file", home), value
    workspace = app.binder.fields["general.workspace_dir"]
    workspace.var.set(str(tmp_path / "runs" / "first"))  # not there yet: the nearest folder that is
    (tmp_path / "runs").mkdir()
    workspace.browse_buttons["folder"].invoke()
    assert dialogs.file_dialogs[-1] == ("folder", str(tmp_path / "runs"))
    app.load_button.invoke()
    assert dialogs.file_dialogs[-1][0] == "open config" and dialogs.file_dialogs[-1][1] == home


def test_finished_says_where_the_model_went(app_factory, tmp_path):
    controller = PlayedController()
    app, _ = app_factory(controller=controller)
    model = str(tmp_path / "ws" / "output" / "demo.safetensors")
    controller.runs = [([{"type": "done", "output": model, "step": 9, "completed": True, "images": 9,
                          "train_s": 3.0, "images_per_s": 3.0}], 0)]
    app.run_view.start_button.invoke()
    assert pump(app, lambda: controller.state.status == "finished", timeout=20)
    pump(app)
    assert app.run_view.status.cget("text") == f"Finished - model saved to {model}"


# --- what people expect: a gallery per run, a backup to continue picked from a list ---------------------
def _samples(workspace: Path, run: str, steps: list[int], prompts: list[str]) -> None:
    folder = workspace / "samples" / run
    folder.mkdir(parents=True, exist_ok=True)
    for step in steps:
        for i in range(len(prompts)):
            _png(folder / f"step-{step:07d}-{i}.png")
    (workspace / "config").mkdir(parents=True, exist_ok=True)
    (workspace / "config" / f"{run}.json").write_text(json.dumps(
        {"sampling": {"prompts": [{"prompt": p} for p in prompts]}}))


def test_sample_index_reads_runs_samplings_and_prompts(tmp_path):
    from ui.sample_gallery import EARLIER, run_folder, run_prompts, sample_runs, samplings
    _samples(tmp_path, "run-20261201-100000", [4, 2], ["a red circle", "a blue square"])
    _samples(tmp_path, "run-20261202-090000", [1], ["a green dot"])
    _png(tmp_path / "samples" / "step-0000003-0.png")  # written before runs had folders
    (tmp_path / "samples" / "run-20261201-100000" / "notes.txt").write_text("not a sample")
    assert sample_runs(tmp_path / "samples") == ["run-20261202-090000", "run-20261201-100000", EARLIER]
    found = samplings(run_folder(tmp_path / "samples", "run-20261201-100000"),
                      run_prompts(tmp_path, "run-20261201-100000"))
    assert [(s.step, [x.prompt for x in s.samples]) for s in found] == \
        [(2, ["a red circle", "a blue square"]), (4, ["a red circle", "a blue square"])]
    assert [s.step for s in samplings(run_folder(tmp_path / "samples", EARLIER))] == [3]
    assert samplings(run_folder(tmp_path / "samples", EARLIER))[0].samples[0].prompt == "prompt 1"


def test_the_gallery_browses_every_sampling_of_every_run(app_factory, tmp_path):
    workspace = tmp_path / "gallery"
    _samples(workspace, "run-20261201-100000", [2, 4, 6], ["a red circle", "a blue square"])
    _samples(workspace, "run-20261202-090000", [1], ["a green dot"])
    controller = PlayedController()
    app, _ = app_factory(controller=controller)
    gallery = app.run_view.gallery
    app.binder.fields["general.workspace_dir"].var.set(str(workspace))
    assert gallery.showing() == ("run-20261202-090000", 1, ["a green dot"])
    assert gallery.run_menu.cget("values") == ["run-20261202-090000", "run-20261201-100000"]
    gallery.choose_run("run-20261201-100000")
    assert gallery.showing() == ("run-20261201-100000", 6, ["a red circle", "a blue square"])
    assert gallery.next.cget("state") == "disabled" and "sampling 3 of 3" in gallery.position.cget("text")
    gallery.previous.invoke()
    gallery.previous.invoke()
    assert gallery.showing()[1] == 2 and gallery.previous.cget("state") == "disabled"
    assert [cell[0].winfo_manager() for cell in gallery.cells[:2]] == ["grid", "grid"]

    # A run that samples while the user looks at an earlier sampling: the view stays; with Newest it follows.
    live = workspace / "samples" / "run-20261203-080000"
    live.mkdir()
    sample = {"type": "sample", "step": 3, "path": str(_png(live / "step-0000003-0.png")), "prompt": "a live cat"}
    later = {"type": "sample", "step": 5, "path": str(live / "step-0000005-0.png"), "prompt": "a live cat"}
    controller.runs = [([sample, 3, later, 60], 0)]
    app.run_view.start_button.invoke()
    assert pump(app, lambda: len(controller.state.samples) == 1, timeout=20)
    pump(app)
    assert gallery.showing() == ("run-20261203-080000", 3, ["a live cat"]), "a new run is followed from its start"
    gallery.choose_run("run-20261201-100000")
    _png(live / "step-0000005-0.png")
    assert pump(app, lambda: len(controller.state.samples) == 2, timeout=20)
    pump(app)
    assert gallery.showing()[0] == "run-20261201-100000", "the user's choice stays while samples come"
    assert gallery.run_menu.cget("values")[0] == "run-20261203-080000"
    gallery.newest.invoke()
    assert gallery.showing() == ("run-20261203-080000", 5, ["a live cat"])
    controller.terminate()


def test_continue_from_a_backup_picked_in_the_list(app_factory, tmp_path):
    import time

    from modules.trainer.backup import mark_finished
    controller = PlayedController()
    app, dialogs = app_factory(controller=controller)
    view, workspace = app.run_view, tmp_path / "picked"
    a50 = _backup(workspace, "run-a", 50)
    _backup(workspace, "run-a", 100)
    mark_finished(workspace / "backups", "run-a", 100, tmp_path / "out.safetensors")
    time.sleep(0.01)
    b7 = _backup(workspace, "run-b", 7)
    app.binder.fields["general.workspace_dir"].var.set(str(workspace))
    labels = view.backups.menu.cget("values")
    assert [label.split(" · ")[:2] for label in labels] == [["run-b", "step 7"], ["run-a", "step 100"],
                                                            ["run-a", "step 50"]]
    assert labels[1].endswith("run finished at step 100") and time.strftime("%Y-%m-%d") in labels[0]
    assert view.backups.picked.path == b7 and view.continue_button.cget("text") == "Continue from step 7"
    view.backups.pick(next(c for c in view.backups.choices if c.path == a50))
    assert view.continue_button.cget("text") == "Continue from step 50"
    app.binder.fields["training.epochs"].var.set("3")  # any edit re-reads the list; the pick stays
    assert view.backups.picked.path == a50
    dialogs.yes_no_answer = False
    view.continue_button.invoke()
    assert controller.started == [] and "finished at step 100" in dialogs.questions[-1]
    dialogs.yes_no_answer = True
    controller.runs = [([], 0)]
    view.continue_button.invoke()
    assert controller.started[-1][-2:] == ["--resume", str(a50)]
    assert pump(app, lambda: not controller.state.active, timeout=20)


def test_a_real_model_preset_starts_with_the_model_picker(app_factory, tmp_path, monkeypatch):
    """Real-model presets opened with a path to nowhere (`models/sdxl_base.safetensors`) in the model field."""
    monkeypatch.chdir(tmp_path)
    app, dialogs = app_factory()
    assert app.load("sdxl_lora")
    assert app.tabs.get() == "Model" and app.model.cfg.model.base_model == ""
    picker = app.model_picker
    assert picker.winfo_manager() == "grid" and "Stable Diffusion XL" in picker.text.cget("text")
    assert app.model.cfg.data.concepts[0].path == "", "the example dataset folder is not there either"
    assert not app.title().endswith("*"), "the preset as opened is not a change"
    dialogs.chosen_path = str(tmp_path / "sdxl.safetensors")
    picker.file_button.invoke()
    assert dialogs.file_dialogs[-1] == ("file", str(Path.home()))
    assert app.model.cfg.model.base_model == dialogs.chosen_path and picker.winfo_manager() == ""
    dialogs.chosen_path = str(tmp_path / "my images")
    folder_button = app.concepts.rows[0][-2]
    assert folder_button.cget("text") == "Folder..."
    folder_button.invoke()
    assert app.model.cfg.data.concepts[0].path == dialogs.chosen_path
    # A preset's example path that does exist (files put where the docs say) is kept; built-in ones too.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "sd15.safetensors").write_bytes(b"")
    assert app.load("sd15_lora") and app.model.cfg.model.base_model == "models/sd15.safetensors"
    assert picker.winfo_manager() == ""
    assert app.load("#demo") and app.model.cfg.model.base_model == "builtin:demo"


def test_the_general_tab_says_what_to_do_first(app_factory, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app, _ = app_factory()
    hint = app.hint
    assert hint.winfo_manager() == "grid"
    text = hint.text.cget("text")
    assert "Try the demo" in text and "Model tab" in text and "Add concept folder" in text
    assert app.load("sd15_lora")
    hint.demo_button.invoke()
    assert app.model.source_name == "#demo" and app.tabs.get() == "Run"
    hint.hide_button.invoke()
    assert hint.winfo_manager() == ""
    assert RecentConfigs(tmp_path / "home").hint_hidden, "hidden for later sessions too"
    again, _ = app_factory()
    assert again.hint is None


@pytest.mark.slow
def test_a_first_time_user_trains_three_times_in_one_window(app_factory, tmp_path, tandem_home):
    """The demo on the CPU, three trainings in one window without restarting it: a full run, a run stopped
    early, and that run continued from its backup. Each start begins clean, each run keeps its samples, and
    nothing goes wrong inside the window. Tiny runs: a few steps, two prompts of two denoising steps."""
    app, _ = app_factory()
    assert app.load("#demo")
    fields, view, gallery = app.binder.fields, app.run_view, app.run_view.gallery
    for path, value in (("general.workspace_dir", str(tmp_path / "ws")), ("general.device", "cpu"),
                        ("training.max_steps", "3"), ("sampling.every_n_steps", "2"),
                        ("sampling.every_n_epochs", "0"), ("sampling.inference_steps", "2"),
                        ("training.batch_size", "2"), ("save.backup_every_n_epochs", "0")):
        fields[path].var.set(value)
    fields["general.tensorboard"].var.set(False)
    app.prompts.remove(2)
    controller = app.controller

    def finish(timeout: float = 400) -> None:
        assert pump(app, lambda: not controller.state.active, timeout=timeout), "\n".join(controller.log)
        pump(app)

    # 1. A whole run.
    view.start_button.invoke()
    assert controller.state.status == "running", view.error_text()
    finish()
    assert controller.state.status == "finished", controller.state.error
    assert view.status.cget("text").startswith("Finished - model saved to ")
    assert Path(controller.state.output).exists()
    first_run, step, prompts = gallery.showing()
    assert step == 3 and prompts == ["a red triangle on a blue background", "a yellow square on a green background"]
    assert [s.step for s in gallery.samplings] == [2, 3]
    assert view.continue_button.cget("state") == "disabled", "nothing is left to continue in a finished run"

    # 2. A longer run, stopped after its first steps: it leaves a backup.
    fields["training.max_steps"].var.set("8")
    view.start_button.invoke()
    assert controller.state.status == "running", view.error_text()
    assert gallery.showing() == (None, None, []) and view.loss_plot.points == []
    assert pump(app, lambda: controller.state.step >= 1 or not controller.state.active, timeout=400)
    view.stop_button.invoke()
    finish()
    assert controller.state.status == "stopped", controller.state.error
    stopped_at = controller.state.step
    assert stopped_at < 8 and view.continue_button.cget("text") == f"Continue from step {stopped_at}"

    # 3. The stopped run, continued to its end.
    view.continue_button.invoke()
    assert controller.state.status == "running", view.error_text()
    finish()
    assert controller.state.status == "finished", controller.state.error
    assert [s for s, _ in view.loss_plot.points] == list(range(1, 9)), "the curve goes on from the backup"
    second_run = gallery.showing()[0]
    assert second_run != first_run and gallery.run_menu.cget("values")[:2] == [second_run, first_run]
    assert gallery.showing()[1] == 8
    gallery.choose_run(first_run)
    assert [s.step for s in gallery.samplings] == [2, 3], "the first run's samples are still its own"
    assert app.crash_text() == "" and len(list((tmp_path / "ws" / "output").iterdir())) >= 2


def test_disabled_menus_look_disabled_too(app_factory):
    from ui.views.buttons import DISABLED_COLOR
    app, _ = app_factory()
    assert app.multi_gpu.cpu_menu.cget("state") == "disabled"  # Multi-GPU is off
    assert app.multi_gpu.cpu_menu.cget("fg_color") == DISABLED_COLOR
    assert app.run_view.backups.menu.cget("fg_color") == DISABLED_COLOR  # no backup
    launcher = app.binder.fields["multi_gpu.launcher"].widget
    assert launcher.cget("fg_color") == DISABLED_COLOR
    app.multi_gpu.enable.widget.toggle()
    assert launcher.cget("fg_color") != DISABLED_COLOR and app.multi_gpu.cpu_menu.cget("fg_color") != DISABLED_COLOR
