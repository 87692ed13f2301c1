"""What people coming from other trainers expect in the window: a sample gallery per run, a backup to continue
picked from a list, a model picker for real-model presets, a getting-started box - and three trainings in one
window. Views under Xvfb."""
from __future__ import annotations

from pathlib import Path

import pytest

from ui.settings import RecentConfigs

from tests.gui.test_ui_widgets import _png, app_factory, pump, shared_window, window  # noqa: F401 - fixtures
from tests.ui_players import PlayedController, make_backup, make_samples

__all__ = ["app_factory", "shared_window", "window"]


def test_sample_index_reads_runs_samplings_and_prompts(tmp_path):
    from ui.sample_gallery import EARLIER, run_folder, run_prompts, sample_runs, samplings
    make_samples(tmp_path, "run-20261201-100000", [4, 2], ["a red circle", "a blue square"])
    make_samples(tmp_path, "run-20261202-090000", [1], ["a green dot"])
    _png(tmp_path / "samples" / "step-0000003-0.png")  # written before runs had folders
    (tmp_path / "samples" / "run-20261201-100000" / "notes.txt").write_text("not a sample")
    assert sample_runs(tmp_path / "samples") == ["run-20261202-090000", "run-20261201-100000", EARLIER]
    found = samplings(run_folder(tmp_path / "samples", "run-20261201-100000"),
                      run_prompts(tmp_path, "run-20261201-100000"))
    assert [(s.step, [x.prompt for x in s.samples]) for s in found] == \
        [(2, ["a red circle", "a blue square"]), (4, ["a red circle", "a blue square"])]
    assert [s.step for s in samplings(run_folder(tmp_path / "samples", EARLIER))] == [3]
    assert samplings(run_folder(tmp_path / "samples", EARLIER))[0].samples[0].prompt == "prompt 1"


@pytest.mark.slow
def test_the_gallery_browses_every_sampling_of_every_run(window, tmp_path):
    workspace = tmp_path / "gallery"
    make_samples(workspace, "run-20261201-100000", [2, 4, 6], ["a red circle", "a blue square"])
    make_samples(workspace, "run-20261202-090000", [1], ["a green dot"])
    controller = PlayedController()
    app, _ = window(controller=controller)
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


@pytest.mark.slow
def test_continue_from_a_backup_picked_in_the_list(window, tmp_path):
    import time

    from modules.trainer.backup import mark_finished
    controller = PlayedController()
    app, dialogs = window(controller=controller)
    view, workspace = app.run_view, tmp_path / "picked"
    a50 = make_backup(workspace, "run-a", 50)
    make_backup(workspace, "run-a", 100)
    mark_finished(workspace / "backups", "run-a", 100, tmp_path / "out.safetensors")
    time.sleep(0.01)
    b7 = make_backup(workspace, "run-b", 7)
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


@pytest.mark.slow
def test_a_real_model_preset_starts_with_the_model_picker(window, tmp_path, monkeypatch):
    """Real-model presets opened with a path to nowhere (`models/sdxl_base.safetensors`) in the model field."""
    monkeypatch.chdir(tmp_path)
    app, dialogs = window()
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
    import customtkinter as ctk
    folder_button = next(w for w in app.concepts.rows[0] if isinstance(w, ctk.CTkButton) and w.cget("text") == "Folder...")
    folder_button.invoke()
    assert app.model.cfg.data.concepts[0].path == dialogs.chosen_path
    # A preset's example path that does exist (files put where the docs say) is kept; built-in ones too.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "sd15.safetensors").write_bytes(b"")
    assert app.load("sd15_lora") and app.model.cfg.model.base_model == "models/sd15.safetensors"
    assert picker.winfo_manager() == ""
    assert app.load("#demo") and app.model.cfg.model.base_model == "builtin:demo"


@pytest.mark.slow
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
def test_a_first_time_user_trains_three_times_in_one_window(window, tmp_path, tandem_home):
    """The demo on the CPU, three trainings in one window without restarting it: a full run, a run stopped
    early, and that run continued from its backup. Each start begins clean, each run keeps its samples, and
    nothing goes wrong inside the window. Tiny runs: a few steps, two prompts of two denoising steps."""
    app, _ = window()
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
