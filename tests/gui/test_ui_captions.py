"""The caption editor: its Tk-free state (pages, filters, one edit, bulk edits shown before written, undo) and
auto-captioning's subprocess, then the window under Xvfb, opened from the Data tab's concept row."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.caption_model import build_tiny_blip
from tests.unit.test_caption_edit import make_folder
from tests.gui.test_ui_widgets import pump, shared_window, window  # noqa: F401 - the fixtures
from ui.caption_controller import AutoCaptionRun, CaptionEditorState, CaptionSource


@pytest.fixture
def folder(tmp_path):
    captions = {f"img{i:02d}": f"photo, red hair, pose {i}" for i in range(14)}
    captions.update({"lonely_cat": None, "sks_dog": "sks, dog"})
    return make_folder(tmp_path / "concept", captions)


def test_state_pages_filters_and_counts(folder):
    state = CaptionEditorState(CaptionSource(str(folder)), page_size=6)
    state.load()
    assert state.pages() == 3 and len(state.page_indexes()) == 6
    state.turn(5)
    assert state.page == 2 and len(state.page_indexes()) == 4
    assert state.summary() == "16 images · 1 without a caption · captions from .txt files"
    assert state.tag_counts()[:2] == [("photo", 14), ("red hair", 14)]
    assert state.missing_names() == ["lonely_cat.png"]
    state.set_filter(only_missing=True)
    assert [state.entries[i].image.name for i in state.page_indexes()] == ["lonely_cat.png"]
    state.set_filter(text="SKS", only_missing=False)
    assert [state.entries[i].image.name for i in state.shown()] == ["sks_dog.png"]
    assert state.summary().endswith("· 1 shown")


def test_state_edits_one_caption_then_bulk_with_undo(folder):
    state = CaptionEditorState(CaptionSource(str(folder)))
    state.load()
    lonely = next(i for i, e in enumerate(state.entries) if e.image.name == "lonely_cat.png")
    assert state.save(lonely, "a cat alone\n") == (True, "Saved lonely_cat.txt.")
    assert (folder / "lonely_cat.txt").read_text() == "a cat alone" and state.entries[lonely].has_caption
    line = state.plan("add_first", "sks")
    assert line == "Add 'sks' first: 15 caption files change."  # sks_dog has it already
    assert (folder / "img00.txt").read_text() == "photo, red hair, pose 0"  # only planned
    assert state.apply() == "Wrote 15 caption files. Undo reverts it."
    assert (folder / "img00.txt").read_text() == "sks, photo, red hair, pose 0"
    assert state.tag_counts()[0] == ("sks", 16)
    assert state.undo() == "Undone: Wrote 15 caption files."
    assert (folder / "img00.txt").read_text() == "photo, red hair, pose 0"
    assert state.undo() == "No bulk edit to undo."
    state.set_filter(text="pose 1")  # pose 1, pose 10..13
    assert state.plan("replace", "red hair", "blue hair") == \
        "Replace 'red hair' with 'blue hair' (text) (in the 5 images shown): 5 caption files change."
    assert state.plan("remove", "") == "Type the tag to remove first."
    assert state.apply() == "Nothing planned: choose an edit first."


@pytest.mark.slow
def test_auto_caption_command_and_progress_lines(tmp_path):
    source = CaptionSource(str(tmp_path), ".caption", True, ";")
    run = AutoCaptionRun(source, "/models/blip", prefix=" sks ", overwrite=True, processes=2, python="py")
    command = run.command()
    assert command[0] == "py" and command[1].endswith("scripts/caption.py")
    assert command[2:] == ["--model", "/models/blip", "--folder", str(tmp_path), "--caption-extension", ".caption",
                           "--separator", ";", "--num-gpus", "2", "--prefix", "sks", "--overwrite", "--recursive"]
    # A stand-in script prints what caption.py prints; its lines become progress.
    script = tmp_path / "fake.py"
    script.write_text("print('3 image(s) to caption in x.')\nprint('[1/3] a.png: a cat')\n"
                      "print('[2/3] b.png: a dog')\nimport sys; print('caption.py: bad folder', file=sys.stderr)\n"
                      "sys.exit(1)\n")
    run = AutoCaptionRun(source, "m")
    run.command = lambda: [sys.executable, str(script)]
    run.start()
    assert pump_until(lambda: run.finished and run.error)
    assert (run.done, run.total, run.fraction()) == (2, 3, 2 / 3)
    assert run.status() == "caption.py: bad folder"
    run.stop()  # ended already: nothing to do
    # Stop ends the script with the processes it started (its own process group).
    script.write_text("import subprocess, sys, time\nprint('1 image(s) to caption in x.', flush=True)\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      "print(child.pid, flush=True)\ntime.sleep(60)\n")
    run = AutoCaptionRun(source, "m")
    run.command = lambda: [sys.executable, str(script)]
    run.start()
    assert pump_until(lambda: run.last_line.isdigit())
    child = int(run.last_line)
    run.stop()
    assert pump_until(lambda: run.finished)
    assert pump_until(lambda: not _alive(child)), "the script's own process outlived Stop"


def _alive(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie, waiting for init to collect it, is gone too
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_auto_caption_with_a_folder_that_is_no_model_says_so_in_one_line(tmp_path):
    folder = make_folder(tmp_path / "c", {"a": None})
    run = AutoCaptionRun(CaptionSource(str(folder)), str(tmp_path))
    run.start()
    assert pump_until(lambda: run.finished, timeout=60)
    assert run.returncode == 2
    assert run.status() == (f"caption.py: {tmp_path} is not a captioning model folder (no config.json): choose the "
                            "folder of a BLIP, Florence-2 or Qwen2-VL model (its config.json, the processor's files "
                            "and the weights).")


def pump_until(until, timeout=20.0):
    import time
    from tests.patience import patience
    end = time.monotonic() + patience(timeout)
    while time.monotonic() < end:
        if until():
            return True
        time.sleep(0.05)
    return until()


def _open_editor(app, folder):
    from ui.views.caption_editor import CaptionEditor

    app.binder.fields["data.concepts[0].path"].var.set(str(folder))
    app.tabs.set("Data")
    row = app.concepts.captions
    assert row.menu.get() == "1: demo shapes" and row.menu.cget("values") == ["1: demo shapes"]
    row.open_button.invoke()
    editors = [w for w in app.winfo_children() if isinstance(w, CaptionEditor)]
    assert editors == [row.editor]
    editor = row.editor
    assert not editor.loaded, "the folder is read off the Tk thread, never while the window waits"
    assert pump(app, lambda: editor.loaded and editor.thumbs_ready, timeout=30), editor.summary.cget("text")
    return editor


@pytest.mark.slow
def test_editor_opens_from_the_data_tab_edits_and_bulk_adds(window, folder):
    app, dialogs = window()
    editor = _open_editor(app, folder)
    assert editor.summary.cget("text").startswith("16 images · 1 without a caption")
    assert len(editor.tiles) == 12 and editor.page_label.cget("text") == "Page 1 of 2"
    assert all(tile.cget("image") for tile in editor.tiles)  # thumbnails in
    editor.next_button.invoke()
    assert pump(app, lambda: editor.thumbs_ready, timeout=10)
    assert len(editor.tiles) == 4 and editor.page_label.cget("text") == "Page 2 of 2"
    lonely = next(t for t in editor.tiles if editor.captions.entries[t.index].image.name == "lonely_cat.png")
    lonely.invoke()
    assert "no caption file yet" in editor.name_label.cget("text")
    editor.caption_box.insert("1.0", "a cat, alone")
    editor.save_button.invoke()
    assert editor.message_text() == "Saved lonely_cat.txt."
    assert (folder / "lonely_cat.txt").read_text() == "a cat, alone"
    # Bulk add: the count first, nothing written until Apply.
    editor.bulk_var.set("sks")
    editor.bulk_buttons["add_first"].invoke()
    assert editor.plan_text() == "Add 'sks' first: 15 caption files change."
    assert (folder / "img03.txt").read_text() == "photo, red hair, pose 3"
    editor.apply_button.invoke()
    assert pump(app, lambda: editor.thumbs_ready, timeout=10)
    assert editor.plan_text() == "Wrote 15 caption files. Undo reverts it."
    assert (folder / "img03.txt").read_text() == "sks, photo, red hair, pose 3"
    assert editor.tags_box.get("1.0", "end").startswith("sks  (16)")
    editor.undo_button.invoke()
    assert (folder / "img03.txt").read_text() == "photo, red hair, pose 3"
    assert editor.undo_button.cget("state") == "disabled"
    # A caption typed and not saved is not lost by choosing another image: asked, then saved.
    editor.caption_box.insert("end", ", curled up")
    other = next(t for t in editor.tiles if t.index != lonely.index)
    other.invoke()
    assert dialogs.questions[-1] == "Save the caption you typed for lonely_cat.png?"
    assert (folder / "lonely_cat.txt").read_text() == "a cat, alone, curled up"
    assert editor.selected == other.index and not editor.typed()
    # Only the images without a caption: none left now.
    editor.missing_box.toggle()
    assert editor.tiles == [] and editor.summary.cget("text").startswith("16 images · 0 without a caption")
    # Closed while its folder is being read: the read's answer finds no window and is dropped quietly.
    editor.reload()
    editor.close()
    pump(app, timeout=1.0)
    assert app.crash_text() == ""
    from modules.config import ConceptConfig
    app.concepts.add(ConceptConfig(path=str(folder), name="second"))
    assert app.concepts.captions.menu.cget("values") == ["1: demo shapes", "2: second"]


@pytest.mark.slow
def test_editor_auto_captions_with_a_local_model(window, tmp_path):
    model = build_tiny_blip(tmp_path / "tiny-blip")
    folder = make_folder(tmp_path / "c", {"a": "kept", "b": None, "c": None})
    app, dialogs = window()
    editor = _open_editor(app, folder)
    editor.auto_button.invoke()
    assert "Choose the captioning model's folder first" in editor.auto_text()
    dialogs.chosen_path = str(model)
    editor.prefix_var.set("sks")
    editor.choose_model()
    editor.auto_button.invoke()
    assert editor.auto_button.cget("text") == "Stop"
    # Done once the editor saw the end: its button back, the folder read again.
    assert pump(app, lambda: editor.auto_button.cget("text") == "Auto-caption" and editor.loaded,
                timeout=240), editor.auto_text()
    assert editor.auto_text().startswith("Captioned 2 of 2 image(s)"), editor.auto_text()
    assert editor.progress.get() == 1.0
    assert (folder / "a.txt").read_text() == "kept"
    assert (folder / "b.txt").read_text().startswith("sks, ")
    assert editor.summary.cget("text").startswith("3 images · 0 without a caption")
    editor.close()
