"""The GUI as a first-time user met it: several runs in one window, states that follow the config and the run,
errors that reach the window. Views under Xvfb, driven through their variables and `.invoke()`."""
from __future__ import annotations

import sys

import pytest

from ui.run_controller import RunController

from tests.gui.test_ui_widgets import (ScriptedController, _png, app_factory, pump,  # noqa: F401 - fixtures
                                   shared_window, window)
from tests.ui_players import PlayedController, make_backup, make_script, run_to_the_end
from tests.patience import patience

__all__ = ["app_factory", "shared_window", "window"]


def test_three_starts_in_one_window_each_show_their_sample(window, tmp_path):
    """Start did nothing from the third run on: the sample label kept the previous run's deleted image
    (`image "pyimage4" doesn't exist`), so clearing it for the next run raised before anything started."""
    controller = ScriptedController()
    app, _ = window(controller=controller)
    view = app.run_view
    for run in range(3):
        folder = tmp_path / "ws" / "samples" / f"run-{run}"
        folder.mkdir(parents=True)
        sample = _png(folder / "step-0000002-0.png")
        run_to_the_end(app, controller, ["1", "2", str(sample), "0"])
        assert controller.state.status == "finished", view.error_text()
        assert view.gallery.showing() == (f"run-{run}", 2, ["a red circle"]), f"run {run + 1}: its sample is not shown"
        assert view.gallery.cells[0][0].cget("text") == ""  # the picture, not a message
    assert len(controller.started) == 3
    # Every run's samples are still there to look at.
    assert view.gallery.run_menu.cget("values") == ["run-2", "run-1", "run-0"]
    view.gallery.choose_run("run-0")
    assert view.gallery.showing() == ("run-0", 2, ["a red circle"])


@pytest.mark.slow
def test_an_exception_in_a_tk_callback_reaches_the_window(window):
    """Tk prints a callback's exception on the terminal and goes on; a window user saw nothing happen."""
    app, _ = window()

    def broken() -> None:
        raise RuntimeError("something inside the window broke")

    app.after(0, broken)
    assert pump(app, lambda: "something inside the window broke" in app.crash_text(), timeout=5)
    assert "RuntimeError" in app.crash_text() and "broken" in app.crash_text()  # the traceback, for a report
    app.crash_dismiss.invoke()
    assert app.crash_text() == ""


@pytest.mark.slow
def test_continue_follows_the_workspace_and_the_preset(window, tmp_path, monkeypatch):
    """Continue kept offering "Continue from step 100" after switching to an empty workspace or another
    preset, and clicking it failed with the command line's wording (`--resume latest: ...`)."""
    import shutil

    monkeypatch.chdir(tmp_path)  # the presets' relative workspaces are empty here
    controller = ScriptedController()
    app, _ = window(controller=controller)
    view, workspace = app.run_view, app.binder.fields["general.workspace_dir"]
    backup = make_backup(tmp_path / "ws2", "run-a", 100)
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
    backup = make_backup(tmp_path / "ws2", "run-b", 40)
    view._update_buttons()
    controller.script = [["41", "42", "-", "0"]]
    view.continue_button.invoke()
    assert controller.started[-1][-2:] == ["--resume", str(backup)]
    assert pump(app, lambda: not controller.state.active, timeout=30)


@pytest.mark.slow
def test_continue_is_not_offered_for_a_finished_run(window, tmp_path):
    """After a finished run Continue was offered: it trained 0 images, wrote another copy of the model and
    cleared the plot. A stopped run's backup is offered; one written after its run finished and was resumed
    again (more epochs) too."""
    import time

    from modules.trainer.backup import mark_finished
    app, _ = window(controller=ScriptedController())
    view, workspace = app.run_view, app.binder.fields["general.workspace_dir"]
    backups = tmp_path / "finished" / "backups"
    make_backup(tmp_path / "finished", "run-a", 50)
    make_backup(tmp_path / "finished", "run-a", 100)
    time.sleep(0.01)
    mark_finished(backups, "run-a", 100, tmp_path / "out.safetensors")
    workspace.var.set(str(tmp_path / "finished"))
    assert view.continue_button.cget("state") == "disabled"
    assert view.continue_button.cget("text") == "Continue from backup"
    make_backup(tmp_path / "finished", "run-a", 130)  # the finished run, resumed with more epochs and stopped
    view._update_buttons()
    assert view.continue_button.cget("text") == "Continue from step 130"


@pytest.mark.slow
def test_the_status_line_drops_a_save_once_it_is_done(window):
    """After "Save now" the status said "Running - saving demo-step0000029" for the rest of the run."""
    controller = PlayedController()
    app, _ = window(controller=controller)
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


@pytest.mark.slow
def test_open_buttons_say_when_nothing_opened(window, tmp_path, monkeypatch):
    """"Open output folder" and "Open TensorBoard" said they had opened something when nothing had: the
    opener's exit status was not read, nor whether TensorBoard came up."""
    from modules.config.run_paths import RunPaths
    from ui import external
    opener = make_script(tmp_path / "xdg-open", "#!/bin/sh\necho 'xdg-open: no method available for opening' >&2\nexit 3\n")
    monkeypatch.setattr(external.sys, "platform", "linux")
    monkeypatch.setattr(external.shutil, "which", lambda name: str(opener) if name == "xdg-open" else None)
    app, _ = window()
    view = app.run_view
    view.output_button.invoke()
    assert pump(app, lambda: "Could not open" in view.notice_text(), timeout=20), view.notice_text()
    assert "no method available for opening" in view.notice_text()
    assert str(RunPaths(app.model.cfg).output_dir.resolve()) in view.notice_text()

    view.tensorboard.python = str(make_script(tmp_path / "python-without-tensorboard",
                                          "#!/bin/sh\necho 'No module named tensorboard' >&2\nexit 1\n"))
    view.tensorboard_button.invoke()
    assert pump(app, lambda: "could not start" in view.notice_text(), timeout=20), view.notice_text()
    assert "No module named tensorboard" in view.notice_text()

    # A server that answers, and a browser that does not open.
    view.tensorboard.python = str(make_script(tmp_path / "python-serving", f"#!{sys.executable}\n" + (
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


@pytest.mark.slow
def test_a_concept_row_wider_than_the_window_scrolls_sideways(window):
    """At 1024 px the Data tab's concept row was wider than the window and its Remove button out of reach."""
    app, _ = window()
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


@pytest.mark.slow
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
    assert time.monotonic() - began < patience(1.0), "close() waited for training on the Tk thread"
    assert controller.state.status == "stopping" and "closing" in app.title().lower()
    deadline = time.monotonic() + patience(180)  # a busy machine: the loop ends as soon as it is done
    while not app.closed and time.monotonic() < deadline:
        app.update()
        time.sleep(0.02)
    assert app.closed and not controller.state.active


@pytest.mark.slow
def test_an_ended_run_shows_the_rate_of_the_whole_run(window):
    """A run stopped at step 2 showed "797.55 images/s" (real rate 0.5): the last report's step rate."""
    controller = PlayedController()
    app, _ = window(controller=controller)
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


@pytest.mark.slow
def test_save_warns_about_problems_and_unread_text_counts_as_unsaved(window, tmp_path):
    """Save wrote "batch_size": -2 without a word, and text that could not be read ("fast" as a learning
    rate) did not set the unsaved marker, so closing lost it silently."""
    from modules.config import read_json
    app, dialogs = window()
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


@pytest.mark.slow
def test_finished_says_where_the_model_went(window, tmp_path):
    controller = PlayedController()
    app, _ = window(controller=controller)
    model = str(tmp_path / "ws" / "output" / "demo.safetensors")
    controller.runs = [([{"type": "done", "output": model, "step": 9, "completed": True, "images": 9,
                          "train_s": 3.0, "images_per_s": 3.0}], 0)]
    app.run_view.start_button.invoke()
    assert pump(app, lambda: controller.state.status == "finished", timeout=20)
    pump(app)
    assert app.run_view.status.cget("text") == f"Finished - model saved to {model}"
