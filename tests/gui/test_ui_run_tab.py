"""The Run tab: Continue offers what a Stop wrote, the tab follows the workspace, the "could not
open" line wraps and goes at the next action, Sample now answers at once, and the remote form fits at
1024 x 768. Views under Xvfb, driven through their variables and `.invoke()`."""
from __future__ import annotations

import sys
import pytest

from tests.gui.test_ui_widgets import _png, pump, shared_window, window  # noqa: F401 - fixtures
from tests.ui_players import PlayedController, make_backup, make_script

__all__ = ["shared_window", "window"]


def _screenshot(app, path) -> None:
    """The window as it is now, as a PNG (in TANDEM_SCREENSHOT_DIR when set, to look at by hand)."""
    import os
    from pathlib import Path

    from PIL import ImageGrab
    folder = os.environ.get("TANDEM_SCREENSHOT_DIR")
    target = Path(folder) / Path(path).name if folder else Path(path)
    x, y = app.winfo_rootx(), app.winfo_rooty()
    ImageGrab.grab(bbox=(x, y, x + app.winfo_width(), y + app.winfo_height()),
                   xdisplay=os.environ["DISPLAY"]).save(target)


def _progress(step: int, total: int = 40) -> dict:
    return {"type": "progress", "epoch": 1, "epochs": 1, "step": step, "total_steps": total, "images_per_s": 2.0,
            "eta_s": 10}


@pytest.mark.slow
def test_after_a_stop_continue_offers_the_backup_the_stop_wrote(window, tmp_path):
    """A backup picked by hand stayed picked: "Stopped · step 23" beside "Continue from step 13", and pressing
    it threw steps 14-23 away."""
    controller = PlayedController()
    controller.stop_timeout_s = 0.5  # the played run ignores Stop: it is ended then, as a stuck one would be
    app, _ = window(controller=controller)
    view, workspace = app.run_view, tmp_path / "ws"
    a13 = make_backup(workspace, "run-a", 13)
    make_backup(workspace, "run-b", 4)  # newer: what Continue offers by itself
    view._update_buttons()
    view.backups.pick(next(c for c in view.backups.choices if c.path == a13))
    assert view.continue_button.cget("text") == "Continue from step 13"
    a23 = workspace / "backups" / "run-a" / "step-00000023"
    controller.runs = [([{"type": "config", "run_id": "run-a", "world_size": 1, "total_steps": 40},
                         _progress(23), {"type": "backup", "path": str(a23), "step": 23}, 60], 0)]
    view.continue_button.invoke()
    assert controller.started[-1][-2:] == ["--resume", str(a13)]
    assert pump(app, lambda: controller.state.backups, timeout=20), "\n".join(controller.log)
    make_backup(workspace, "run-a", 23)  # the Stop's backup, on disk
    view.stop_button.invoke()
    assert pump(app, lambda: controller.state.status == "stopped", timeout=30), controller.state.headline
    pump(app)
    assert view.status.cget("text").startswith("Stopped")
    assert view.continue_button.cget("text") == "Continue from step 23", view.backups.menu.get()
    assert view.backups.picked.path == a23
    app.binder.fields["training.epochs"].var.set("3")  # a later edit reads the list again: the offer stays
    assert view.continue_button.cget("text") == "Continue from step 23"


@pytest.mark.slow
def test_the_run_tab_follows_the_workspace(window, tmp_path):
    """After another workspace, a preset or an import, the Run tab still showed the previous workspace's run -
    its status, loss plot, error, log and samples - while Continue said "No backup in this workspace"."""
    controller = PlayedController()
    app, dialogs = window(controller=controller)
    dialogs.show_info = lambda title, text: None  # the import's summary
    view, fields = app.run_view, app.binder.fields
    samples = tmp_path / "ws" / "samples" / "run-x"
    samples.mkdir(parents=True)
    sample = _png(samples / "step-0000002-0.png")

    def a_failed_run() -> None:
        fields["general.workspace_dir"].var.set(str(tmp_path / "ws"))
        controller.runs = [([{"type": "config", "run_id": "run-x", "world_size": 1, "total_steps": 40},
                             {"type": "loss", "step": 1, "loss": 0.5, "lr": 1e-4},
                             {"type": "loss", "step": 2, "loss": 0.4, "lr": 1e-4}, _progress(2),
                             {"type": "sample", "step": 2, "path": str(sample), "prompt": "a red circle", "rank": 0},
                             "a log line", {"type": "error", "text": "something broke", "rank": 0}], 1)]
        view.start_button.invoke()
        assert pump(app, lambda: controller.state.status == "failed", timeout=20), controller.state.headline
        pump(app)
        assert view.status.cget("text") == "Failed" and view.loss_plot.points and "something broke" in view.error_text()
        assert view.gallery.showing()[0] == "run-x" and "a log line" in view.log.get("1.0", "end")

    def shows_no_run(after: str) -> None:
        seen = (view.status.cget("text"), view.loss_plot.points, view.progress_text.cget("text"), view.error_text(),
                view.log.get("1.0", "end").strip(), view.gallery.showing())
        assert seen == ("Idle", [], "", "", "", (None, None, [])), f"after {after} the Run tab shows {seen}"
        assert view.backups.menu.get() == "No backup in this workspace"

    a_failed_run()
    fields["general.workspace_dir"].var.set(str(tmp_path / "other"))
    shows_no_run("another workspace")
    fields["general.workspace_dir"].var.set(str(tmp_path / "ws"))
    assert view.gallery.showing()[0] == "run-x", "the workspace's samples are there again"
    assert view.status.cget("text") == "Idle"

    a_failed_run()
    assert app.load("#demo")
    shows_no_run("loading a preset")

    a_failed_run()
    kohya = tmp_path / "kohya.toml"
    kohya.write_text('learning_rate = 0.0002\noutput_name = "imported"\n')
    assert app.import_file(str(kohya))
    shows_no_run("an import")


@pytest.mark.slow
def test_the_could_not_open_line_wraps_and_goes_at_the_next_action(window, tmp_path, monkeypatch):
    """"Could not open a file manager (... gio failed: gi" was cut off at the entry's width, and stayed."""
    from ui import external
    reason = ("gio failed: giving up on the handler of the desktop for inode/directory after asking "
              "org.freedesktop.FileManager1 over D-Bus: the name is not activatable, no service file provides it")
    opener = make_script(tmp_path / "xdg-open", f"#!/bin/sh\necho '{reason}' >&2\nexit 3\n")
    monkeypatch.setattr(external.sys, "platform", "linux")
    monkeypatch.setattr(external.shutil, "which", lambda name: str(opener) if name == "xdg-open" else None)
    controller = PlayedController()
    app, _ = window(controller=controller)
    app.geometry("1024x768+0+0")
    app.tabs.set("Run")
    view = app.run_view
    view.output_button.invoke()
    assert pump(app, lambda: "Could not open" in view.notice_text(), timeout=20), view.notice_text()
    pump(app, timeout=0.5)
    notice = view.notice
    assert notice.text().rstrip().endswith("The folder is " + str((tmp_path / "ws" / "output").resolve()))
    assert reason in notice.text()
    lines = notice.display_lines()
    assert lines >= 2, "the message should need more than one line at 1024 px"
    first, last = notice._textbox.dlineinfo("1.0"), notice._textbox.dlineinfo("end-1c")
    assert last is not None and last[3] == first[3], f"the last line is cut: {last} (a whole line: {first})"
    assert notice.winfo_rootx() + notice.winfo_width() <= app.winfo_rootx() + app.winfo_width()
    _screenshot(app, tmp_path / "could-not-open-1024x768.png")
    # The next action takes it away: an edit, or a Start.
    app.binder.fields["training.epochs"].var.set("3")
    assert view.notice_text() == ""
    view.output_button.invoke()
    assert pump(app, lambda: "Could not open" in view.notice_text(), timeout=20), view.notice_text()
    controller.runs = [([], 0)]
    view.start_button.invoke()
    assert view.notice_text() == ""
    assert pump(app, lambda: not controller.state.active, timeout=20)


@pytest.mark.slow
def test_sample_now_is_answered_at_once(window):
    """After "Sample now" nothing changed for a minute (the next step, then the rendering)."""
    controller = PlayedController()
    app, _ = window(controller=controller)
    view = app.run_view
    controller.runs = [([_progress(1), 60], 0)]
    view.start_button.invoke()
    assert pump(app, lambda: controller.state.step == 1, timeout=20)
    pump(app)
    assert view.status.cget("text") == "Running"
    view.sample_button.invoke()
    assert view.status.cget("text") == "Running - sampling at the next step"
    controller.terminate()


@pytest.mark.slow
def test_the_remote_form_fits_at_1024x768(window, tmp_path):
    """At 1024 x 768 the third column of the remote machine's fields ("Python there", "Environment") was cut off."""
    import customtkinter as ctk

    from ui.views.remote_frame import NEW_REMOTE
    app, _ = window()
    app.geometry("1024x768+0+0")
    app.tabs.set("Run")
    app.remote.menu.set(NEW_REMOTE)
    app.remote.choose(NEW_REMOTE)
    pump(app, timeout=1.0)
    right, bottom = app.winfo_rootx() + app.winfo_width(), app.winfo_rooty() + app.winfo_height()
    cells = app.remote.fields.winfo_children()  # each field's label and entry
    assert len(cells) >= 16
    cut = []
    for widget in cells:
        edge = (widget.winfo_rootx() + widget.winfo_width(), widget.winfo_rooty() + widget.winfo_height())
        if not widget.winfo_ismapped() or edge[0] > right or edge[1] > bottom:
            cut.append((widget.cget("text") if isinstance(widget, ctk.CTkLabel) else "an entry", edge))
    assert not cut, f"cut off at 1024 x 768 (window edge {right}, {bottom}): {cut}"
    for button in (app.run_view.start_button, app.remote.check_button):
        assert button.winfo_ismapped() and button.winfo_rooty() + button.winfo_height() <= bottom
    _screenshot(app, tmp_path / "remote-form-1024x768.png")  # TANDEM_SCREENSHOT_DIR keeps it, to look at
    # In a wide window the fields stand three to a row again.
    app.geometry("1400x820+0+0")
    pump(app, timeout=1.0)
    assert max(int(widget.grid_info()["row"]) for widget in cells) == 2, "not three to a row"
