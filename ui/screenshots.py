"""Render a PNG of every GUI tab into docs/images/ (for docs/GUI.md), behind scripts/render_screenshots.py.

    python scripts/render_screenshots.py [--out docs/images] [--example-gpus 2]

Starts its own Xvfb display, opens the demo preset (the General tab with its getting-started box, as a
first start shows it), the SDXL LoRA preset's model picker, and for the Run tab really trains the demo on
2 CPU processes for a few steps, so the progress, loss plot, per-rank numbers, sample gallery and log are
real; after a stop, the list of backups to continue; the Run tab is also shown at 1024x600.
The Tools tab is shown after a real merge of a random LoRA into the demo model, and after a resize by
kept energy (`--tools`: only those), and the caption editor on a copy of the demo's images (`--captions`: only
that).
`--remote` renders the pictures of docs/Remote.md instead: the Run tab running the demo on a "remote" machine
that is this one, reached through a throwaway sshd on 127.0.0.1 (modules/remote/local_sshd.py).
`--example-gpus N` shows N made-up 80 GiB GPUs in the multi-GPU frame (for machines without
GPUs); the picture's caption in docs/GUI.md says so.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def start_xvfb() -> subprocess.Popen:
    if shutil.which("Xvfb") is None:
        sys.exit("Xvfb is needed: apt-get install xvfb")
    number = next(n for n in range(90, 200) if not Path(f"/tmp/.X{n}-lock").exists())
    server = subprocess.Popen(["Xvfb", f":{number}", "-screen", "0", "1180x900x24", "-nolisten", "tcp"])
    while not Path(f"/tmp/.X11-unix/X{number}").exists():
        time.sleep(0.05)
    os.environ["DISPLAY"] = f":{number}"
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/images")
    parser.add_argument("--example-gpus", type=int, default=0)
    parser.add_argument("--run-steps", type=int, default=20, help="demo steps before the Run tab is captured")
    parser.add_argument("--remote", action="store_true", help="only the remote-training pictures (needs sshd)")
    parser.add_argument("--tools", action="store_true", help="only the Tools tab's pictures")
    parser.add_argument("--captions", action="store_true", help="only the caption editor's picture")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    server = start_xvfb()
    try:
        if args.remote:
            render_remote(Path(args.out), args.run_steps)
        elif args.tools:
            render_tools(Path(args.out))
        elif args.captions:
            render_captions(Path(args.out))
        else:
            render(Path(args.out), args.example_gpus, args.run_steps)
    finally:
        server.terminate()


def _shooter(app, out: Path):
    from PIL import ImageGrab

    def settle(seconds: float = 0.6) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            app.update()
            time.sleep(0.02)

    def shoot(name: str) -> None:
        settle()
        x, y = app.winfo_rootx(), app.winfo_rooty()
        ImageGrab.grab(bbox=(x, y, x + app.winfo_width(), y + app.winfo_height()),
                       xdisplay=os.environ["DISPLAY"]).save(out / f"{name}.png")
        print("wrote", out / f"{name}.png")
    return settle, shoot


def render_remote(out: Path, run_steps: int) -> None:
    """The Run tab with "Run on" a remote machine: its check, then the demo training there."""
    from modules.remote.local_sshd import SshServer, sshd_problem
    from ui.settings import RecentConfigs, SavedRemotes
    from ui.views.app import TandemApp

    problem = sshd_problem()
    if problem:
        sys.exit(problem)
    out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="tandem-shots-remote-"))
    sshd = SshServer(home / "sshd").start()
    try:
        remotes = SavedRemotes(home)
        # The machine accepted once already (the picture shows a known machine); the existing-Python option
        # spares the picture an install.
        key = (sshd.folder / "host_key.pub").read_text().split()
        (home / "known_hosts").write_text(f"[127.0.0.1]:{sshd.port} {key[0]} {key[1]}\n")
        remotes.save(sshd.remote(home / "remote", python=sys.executable, environment="OMP_NUM_THREADS=1"))
        app = TandemApp(recent=RecentConfigs(home), gpu_probe=lambda: [])
        app.geometry("1100x860+0+0")
        settle, shoot = _shooter(app, out)
        app.load("#demo")
        for path, value in (("general.workspace_dir", str(home / "workspace")), ("training.max_steps", "400"),
                            ("training.batch_size", "2"), ("sampling.every_n_epochs", "0"),
                            ("sampling.every_n_steps", "10"), ("sampling.inference_steps", "10")):
            app.binder.fields[path].var.set(value)
        app.tabs.set("Run")
        deadline = time.monotonic() + 120
        while "connected" not in app.remote.notice_text() and time.monotonic() < deadline:
            settle(0.2)
        shoot("remote-check")
        if not app.run_view.start():
            sys.exit("could not start the remote demo run:\n" + app.run_view.error_text())
        controller = app.remote.current
        deadline = time.monotonic() + 600
        while controller.state.active and time.monotonic() < deadline and (
                controller.state.step < run_steps or not controller.state.samples):
            settle(0.2)
        shoot("remote-run")
        controller.stop()
        while controller.state.active and time.monotonic() < deadline + 120:
            settle(0.2)
        app.destroy()
    finally:
        sshd.stop()


def render(out: Path, example_gpus: int, run_steps: int) -> None:
    from ui.gpu_info import GpuInfo, detect_gpus
    from ui.settings import RecentConfigs
    from ui.views.app import TandemApp

    out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="tandem-shots-"))
    gpus = [GpuInfo(i, "NVIDIA H100 80GB HBM3 (example)", 81559) for i in range(example_gpus)]
    app = TandemApp(recent=RecentConfigs(home), gpu_probe=(lambda: gpus) if example_gpus else detect_gpus)
    app.geometry("1100x860+0+0")
    settle, shoot = _shooter(app, out)

    while app.multi_gpu.detecting:
        settle(0.1)
    # A real-model preset opens on the Model tab, asking for the model (its example path is not there).
    app.load("sdxl_lora")
    shoot("model-picker")
    app.load("#demo")
    app.binder.fields["general.workspace_dir"].var.set(str(home / "workspace"))
    for tab in ("General", "Model", "Data", "Training", "Sampling", "Backup & Save"):
        app.tabs.set(tab)
        shoot("tab-" + tab.lower().replace(" & ", "-"))
    app.tabs.set("Training")
    app.multi_gpu.enable.widget.toggle()
    if len(gpus) < 2:
        app.multi_gpu._cpu_chosen("2")
    app.multi_gpu.lr_scaling.var.set("sqrt")
    deadline = time.monotonic() + 60
    while "estimating" in app.multi_gpu.memory.cget("text") and time.monotonic() < deadline:
        settle(0.2)
    settle()
    # the frame from its heading down: the tab scrolled so that the frame's top is the view's top
    canvas = app.multi_gpu.master._parent_canvas
    top, height = app.multi_gpu.winfo_y(), float(canvas.bbox("all")[3])
    canvas.yview_moveto(max(0.0, (top - 8) / height))
    shoot("multi-gpu-frame")

    # The Run tab with a real (short) demo run on 2 CPU processes, sampling every few steps for the gallery.
    app.multi_gpu._cpu_chosen("2")
    app.binder.fields["sampling.every_n_epochs"].var.set("0")
    app.binder.fields["sampling.every_n_steps"].var.set(str(max(1, run_steps // 2)))
    app.binder.fields["sampling.inference_steps"].var.set("10")
    app.tabs.set("Run")
    if not app.run_view.start():
        sys.exit("could not start the demo run:\n" + app.run_view.error_text())
    deadline = time.monotonic() + 300
    state = app.controller.state
    while state.active and time.monotonic() < deadline and (state.step < run_steps or len(state.samples) < 6):
        settle(0.2)
        state = app.controller.state
    app.run_view._parent_canvas.yview_moveto(0.0)
    shoot("tab-run")
    # The same at 1024x600 (a laptop screen): the tab scrolls; shown scrolled to the per-GPU view and log.
    app.geometry("1024x600+0+0")
    settle()
    app.run_view._parent_canvas.yview_moveto(0.45)
    shoot("tab-run-1024x600")
    app.controller.stop()
    while app.controller.state.active and time.monotonic() < deadline + 60:
        settle(0.2)
    app.controller.terminate()
    # Stopped: its backup is in the list to continue from, the gallery keeps the run's samplings.
    app.geometry("1100x860+0+0")
    settle()
    app.run_view._parent_canvas.yview_moveto(0.0)
    shoot("tab-run-stopped")
    app.destroy()
    render_tools(out)
    render_captions(out)


def render_captions(out: Path) -> None:
    """The caption editor on a copy of the demo's images, two of them without a caption, one chosen and a
    bulk add of a trigger word planned (not applied)."""
    from modules.data.builtin_datasets import resolve_concept_path
    from ui.settings import RecentConfigs
    from ui.views.app import TandemApp

    out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="tandem-shots-captions-"))
    folder = home / "shapes"
    shutil.copytree(resolve_concept_path("builtin:demo-shapes"), folder, ignore=shutil.ignore_patterns(".*"))
    captions = sorted(folder.glob("*.txt"))
    for caption in captions:  # "a red circle on a green background" as tags: "circle, red, green background"
        words = caption.read_text().split()
        if len(words) == 7:
            caption.write_text(f"{words[2]}, {words[1]}, {words[5]} background")
    for caption in captions[1:6:4]:
        caption.unlink()
    app = TandemApp(recent=RecentConfigs(home), gpu_probe=lambda: [])
    app.geometry("1100x860+0+0")
    settle, _ = _shooter(app, out)
    app.binder.fields["data.concepts[0].path"].var.set(str(folder))
    app.binder.fields["data.concepts[0].name"].var.set("shapes")
    app.tabs.set("Data")
    editor = app.concepts.captions.open()
    deadline = time.monotonic() + 120
    while not (editor.loaded and editor.thumbs_ready) and time.monotonic() < deadline:
        settle(0.2)
    editor.geometry("1080x780+0+0")
    editor.tiles[2].invoke()
    editor.bulk_var.set("shapes style")
    editor.bulk_buttons["add_first"].invoke()
    settle(1.0)
    _, shoot_editor = _shooter(editor, out)
    shoot_editor("caption-editor")
    editor.close()
    app.destroy()


def render_tools(out: Path) -> None:
    """The Tools tab after a merge of a random LoRA into the demo model, then after a resize by kept energy."""
    import torch

    from modules.config.train_config import ModelConfig, TrainingConfig
    from modules.model import add_lora, load_model, save_lora
    from ui.settings import RecentConfigs
    from ui.views.app import TandemApp

    out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="tandem-shots-tools-"))
    bundle = load_model(ModelConfig())
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in add_lora(bundle, TrainingConfig(lora_rank=16, lora_alpha=16)):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    lora = save_lora(bundle, home / "my_style.safetensors", "kohya", "fp16")
    app = TandemApp(recent=RecentConfigs(home), gpu_probe=lambda: [])
    app.geometry("1100x860+0+0")
    settle, shoot = _shooter(app, out)
    app.tabs.set("Tools")
    view = app.lora_tools
    for tool, values in (("merge", {"lora": str(lora), "out": str(home / "my_style_merged")}),
                         ("resize", {"lora": str(lora), "out": str(home / "my_style_small.safetensors"),
                                     "rank": "16", "energy": "0.9"})):
        view.select(tool)
        for key, value in values.items():
            view.values[tool][key].set(value)
        view.run()
        deadline = time.monotonic() + 300
        while view.controller.state.running and time.monotonic() < deadline:
            settle(0.2)
        shoot("tab-tools" if tool == "merge" else f"tab-tools-{tool}")
    app.destroy()
