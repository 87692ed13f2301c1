"""What the window says and how it behaves in the hand: wording, labels, tooltips, the log, disabled controls,
the wheel, Ctrl+A, file dialogs. Views under Xvfb."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest

from tests.gui.test_ui_widgets import pump, shared_window, window  # noqa: F401 - the fixtures
from tests.ui_players import PlayedController

__all__ = ["shared_window", "window"]


@pytest.mark.slow
def test_multi_gpu_wording_says_what_is_true_for_this_setup(window):
    """'0 GPU visible'; 'node 0 listens on 127.0.0.1:a fixed port.' with no word that 127.0.0.1 is out of reach
    of another machine; a GUI user told to pass --master-port; 'backups every 10 minutes unless a backup
    cadence is set' beside an epoch cadence; CPU processes called GPU 0/GPU 1; the batch split's own example
    invalid with the demo's defaults; 'every rank stops' in a one-process run."""
    from ui.binding import field_label
    from ui.gpu_info import GpuInfo
    from modules.util.batch_slice import parse_split
    controller = PlayedController()
    app, _ = window(controller=controller)
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


@pytest.mark.slow
def test_multi_gpu_off_disables_its_controls_and_gives_the_device_back(window):
    """With Multi-GPU off, CPU processes, Launcher and the batch split stayed enabled; choosing CPU processes
    set General › Device to cpu without a word, and it stayed so after Multi-GPU was turned off."""
    app, _ = window()
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


@pytest.mark.slow
def test_labels_are_in_one_style(window):
    """"Lora format", "Ema weights", "Unet dtype", "Eps" beside "LoRA rank": a label made from a field's name
    keeps the usual spelling of the words in it."""
    import re
    app, _ = window()
    labels = {path: label for path, (_tab, label) in app.binder.places.places.items()}
    wrong = re.compile(r"\b(Lora|Ema|Unet|Vae|Eps|Lr|Gpu|Gpus|Ddp|Fsdp|Snr|Tf32|Cpu|Mb)\b")
    assert [f"{p}: {label}" for p, label in labels.items() if wrong.search(label)] == []
    assert labels["save.lora_format"] == "LoRA format" and labels["model.unet_dtype"] == "UNet dtype"
    assert labels["optimizer.eps"] == "Epsilon"


def _every_tooltip(app) -> list[str]:
    from ui.views.tooltip import Tooltip
    pump(app)
    return sorted({t.text for t in Tooltip._by_widget().values()})


@pytest.mark.slow
def test_tooltips_and_messages_speak_to_a_window_user(window):
    """Tooltips and errors showed config paths and names (`nnodes`, `timeout_minutes`), command-line flags
    (`--assume-free-gib`, `--node-rank 1`) and the history of development (a session number with a docs path)."""
    import re

    from modules.config import TrainConfig
    from modules.config.field_paths import leaf_paths
    from ui.gpu_info import GpuInfo
    app, _ = window(gpus=[GpuInfo(0, "Fake GPU", 81920), GpuInfo(1, "Fake GPU", 81920)])
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


@pytest.mark.slow
def test_the_log_shows_each_line_once_in_words(window):
    """The log repeated each human line as a raw event dump: `[backup] path=..., paused_s=0.077`."""
    controller = PlayedController()
    app, _ = window(controller=controller)
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


@pytest.mark.slow
def test_disabled_buttons_look_disabled(window):
    """Disabled buttons kept their colour: a disabled red Stop looked ready to click."""
    from ui.views.buttons import DISABLED_COLOR
    controller = PlayedController()
    app, _ = window(controller=controller)
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


@pytest.mark.slow
def test_disabled_menus_look_disabled_too(window):
    from ui.views.buttons import DISABLED_COLOR
    app, _ = window()
    assert app.multi_gpu.cpu_menu.cget("state") == "disabled"  # Multi-GPU is off
    assert app.multi_gpu.cpu_menu.cget("fg_color") == DISABLED_COLOR
    assert app.run_view.backups.menu.cget("fg_color") == DISABLED_COLOR  # no backup
    launcher = app.binder.fields["multi_gpu.launcher"].widget
    assert launcher.cget("fg_color") == DISABLED_COLOR
    app.multi_gpu.enable.widget.toggle()
    assert launcher.cget("fg_color") != DISABLED_COLOR and app.multi_gpu.cpu_menu.cget("fg_color") != DISABLED_COLOR


@pytest.mark.slow
def test_the_wheel_over_the_log_scrolls_the_page_once_the_log_is_at_its_end(window):
    """The mouse wheel over the log scrolled only the box: with the pointer there, the page did not move."""
    app, _ = window()
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


@pytest.mark.slow
def test_ctrl_a_selects_a_whole_field(window):
    app, _ = window()
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


@pytest.mark.slow
def test_file_dialogs_open_where_the_field_points_and_cancel_is_final(window, tmp_path, monkeypatch):
    """File dialogs opened in the program's folder, and Browse > Cancel on the base model opened a second
    (folder) dialog."""
    monkeypatch.chdir(tmp_path)
    models = tmp_path / "models"
    models.mkdir()
    (models / "sd15.safetensors").write_bytes(b"")
    app, dialogs = window()
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
