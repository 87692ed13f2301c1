"""The LoRA tools (merge, resize, extract; modules/model/lora_tools.py, lora_resize.py): what each writes is what
the math says and what diffusers makes of the same files, it loads back in diffusers, bad input gets one line,
and the GUI's Tools tab runs them without blocking the window."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from modules.config.train_config import ModelConfig, TrainingConfig
from modules.model import add_lora, ensure_demo_model, load_model, save_lora
from modules.model.lora_resize import resize
from modules.model.lora_tools import ToolError, extract, merge
from modules.util.tool_lines import parse_tool_line, tool_line
from tests.patience import patience
from tests.gui.test_ui_widgets import shared_window, window  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[2]
CONV = "down_blocks.0.resnets.0.conv1"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _random_lora(tmp_path: Path, fmt: str, rank: int = 6, alpha: float = 3.0, text: bool = True) -> Path:
    """A LoRA of the demo model with random (not zero) weights, saved by Tandem in `fmt`."""
    bundle = load_model(ModelConfig())
    params = add_lora(bundle, TrainingConfig(lora_rank=rank, lora_alpha=alpha, lora_target_modules=TARGETS,
                                             train_text_encoder=text))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in params:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return save_lora(bundle, tmp_path / f"random_{fmt}.safetensors", fmt, "fp32")


def _pipeline():
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(ensure_demo_model(), local_files_only=True, safety_checker=None)


def _fused(lora: Path, strength: float = 1.0):
    """The demo pipeline with `lora` fused into its weights by diffusers itself."""
    pipeline = _pipeline()
    pipeline.load_lora_weights(str(lora))
    pipeline.fuse_lora(lora_scale=strength, components=["unet", "text_encoder"])
    pipeline.unload_lora_weights()
    return pipeline


def _weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float() for k, v in module.state_dict().items()}


def _assert_same(actual: dict, expected: dict, atol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=atol, msg=key)


# ------------------------------------------------------------------------------ merge


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_merge_equals_diffusers_fuse_lora_and_loads_back(tandem_home, tmp_path, fmt):
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    lora = _random_lora(tmp_path, fmt)
    report = merge("builtin:demo", lora, tmp_path / "merged", strength=0.7, dtype="fp32", device="cpu")
    assert report.layers > 20 and "merged" in report.line()

    expected = _fused(lora, 0.7)
    unet = UNet2DConditionModel.from_pretrained(tmp_path / "merged", subfolder="unet")
    text = CLIPTextModel.from_pretrained(tmp_path / "merged", subfolder="text_encoder")
    base = _pipeline()
    assert not torch.allclose(unet.state_dict()["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"],
                              base.unet.state_dict()["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"])
    _assert_same(_weights(unet), _weights(expected.unet))
    _assert_same(_weights(text), _weights(expected.text_encoder))
    # The whole folder loads as a pipeline, the way users open it.
    from diffusers import StableDiffusionPipeline
    assert StableDiffusionPipeline.from_pretrained(tmp_path / "merged", local_files_only=True, safety_checker=None)


@pytest.mark.slow
def test_merge_to_a_single_file_is_the_math(tandem_home, tmp_path):
    """W + strength x alpha / rank x up @ down, written as one checkpoint in the original layout that diffusers'
    own single-file converter reads back."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    lora = _random_lora(tmp_path, "kohya", rank=4, alpha=8.0, text=False)
    out = merge("builtin:demo", lora, tmp_path / "merged.safetensors", strength=1.5, dtype="fp32", device="cpu").output
    tensors = load_file(lora)
    bundle = load_model(ModelConfig())
    base = bundle.unet.state_dict()
    merged = convert_ldm_unet_checkpoint(load_file(out), dict(bundle.unet.config))
    assert merged.keys() == base.keys()
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    key = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    delta = tensors[f"{name}.lora_up.weight"] @ tensors[f"{name}.lora_down.weight"]
    torch.testing.assert_close(merged[key], base[key] + 1.5 * 8.0 / 4 * delta, rtol=0, atol=1e-5)
    untouched = "conv_in.weight"
    assert torch.equal(merged[untouched], base[untouched])


# ------------------------------------------------------------------------------ resize


def _best(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_resize_keeps_the_best_lower_rank_product_and_loads_in_diffusers(tandem_home, tmp_path, fmt):
    lora = _random_lora(tmp_path, fmt, rank=6, alpha=3.0)
    report = resize(lora, tmp_path / "small.safetensors", rank=2, device="cpu")
    before, after = load_file(lora), load_file(report.output)
    down, up = (".lora_down.weight", ".lora_up.weight") if fmt == "kohya" else (".lora_A.weight", ".lora_B.weight")
    modules = [key[: -len(down)] for key in before if key.endswith(down)]
    assert len(report.layers) == len(modules) > 20
    for name in modules:
        old = before[name + up].flatten(1) @ before[name + down].flatten(1)
        new = after[name + up].flatten(1) @ after[name + down].flatten(1)
        assert after[name + down].shape[0] == 2
        torch.testing.assert_close(new.double(), _best(old, 2), rtol=0, atol=1e-5)
        if fmt == "kohya":  # alpha / rank, the scale the product is applied with, stays 3 / 6
            assert after[name + ".alpha"].item() == pytest.approx(3.0 * 2 / 6)
    for layer in report.layers:
        assert 0 < layer.kept < 1 and (layer.old_rank, layer.new_rank) == (6, 2)

    # diffusers applies the resized file as the best rank-2 version of the original change.
    base, resized = _pipeline(), _fused(report.output)
    key = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    name = f"lora_unet_{key.replace('.', '_')}" if fmt == "kohya" else f"unet.{key}"
    change = resized.unet.state_dict()[key + ".weight"] - base.unet.state_dict()[key + ".weight"]
    expected = 0.5 * _best(before[name + up] @ before[name + down], 2)
    torch.testing.assert_close(change.double(), expected, rtol=0, atol=1e-5)
    with safe_open(report.output, "pt") as f:
        metadata = f.metadata()
    assert metadata["ss_network_dim"] == "2" and float(metadata["ss_network_alpha"]) == pytest.approx(1.0)


@pytest.mark.slow
def test_resize_by_energy_gives_each_module_its_rank(tandem_home, tmp_path):
    """A product of known singular values: the rank that keeps 90% of each, and diffusers reads the mixed
    ranks of the peft file through its header's rank and alpha patterns."""
    lora = _random_lora(tmp_path, "peft", rank=6, alpha=6.0)
    tensors = load_file(lora)
    with safe_open(lora, "pt") as f:
        metadata = f.metadata()
    # Two modules with prescribed singular values: (10, 1, ...) keeps 1 for 90%, flat values need 6.
    steep = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    flat = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k"
    for name, values in ((steep, [10.0, 1, 0.5, 0.2, 0.1, 0.05]), (flat, [1.0] * 6)):
        out_dim, in_dim = tensors[f"{name}.lora_B.weight"].shape[0], tensors[f"{name}.lora_A.weight"].shape[1]
        q_out = torch.linalg.qr(torch.randn(out_dim, 6, generator=torch.Generator().manual_seed(1)))[0]
        q_in = torch.linalg.qr(torch.randn(in_dim, 6, generator=torch.Generator().manual_seed(2)))[0]
        tensors[f"{name}.lora_B.weight"] = (q_out * torch.tensor(values)).contiguous()
        tensors[f"{name}.lora_A.weight"] = q_in.T.contiguous()
    save_file(tensors, tmp_path / "shaped.safetensors", metadata)
    report = resize(tmp_path / "shaped.safetensors", tmp_path / "dynamic.safetensors", energy=0.9, device="cpu")
    ranks = {layer.module: layer.new_rank for layer in report.layers}
    assert ranks[steep] == 1 and ranks[flat] == 6
    assert all(layer.kept >= 0.9 for layer in report.layers)
    assert "rank 1-6" in report.line()

    base, resized = _pipeline(), _fused(report.output)
    for name, rank in ((steep, 1), (flat, 6)):
        key = name.removeprefix("unet.") + ".weight"
        change = resized.unet.state_dict()[key] - base.unet.state_dict()[key]
        expected = _best(tensors[f"{name}.lora_B.weight"] @ tensors[f"{name}.lora_A.weight"], rank)
        torch.testing.assert_close(change.double(), expected, rtol=0, atol=1e-5)

    # Mixed ranks and alphas, which the trainer's reader refuses, merge as diffusers fuses them.
    from diffusers import UNet2DConditionModel
    merged = merge("builtin:demo", report.output, tmp_path / "merged", dtype="fp32", device="cpu").output
    _assert_same(_weights(UNet2DConditionModel.from_pretrained(merged, subfolder="unet")), _weights(resized.unet))


# ------------------------------------------------------------------------------ extract


def _fine_tune(tmp_path: Path, rank: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """The demo model with a change of known rank `rank` added to some Linear layers, saved as a folder."""
    from modules.model import save_full_diffusers

    bundle = load_model(ModelConfig())
    generator = torch.Generator().manual_seed(3)
    deltas = {}
    with torch.no_grad():
        for path, layer in bundle.unet.named_modules():
            if isinstance(layer, torch.nn.Linear) and path.endswith(("to_q", "to_v", "ff.net.2")):
                out_dim, in_dim = layer.weight.shape
                delta = torch.randn(out_dim, rank, generator=generator) @ torch.randn(rank, in_dim, generator=generator)
                layer.weight.add_(delta * 0.05)
                deltas[path] = delta * 0.05
        conv = bundle.unet.get_submodule(CONV)
        out_dim = conv.weight.shape[0]
        delta = torch.randn(out_dim, rank, generator=generator) @ torch.randn(rank, conv.weight[0].numel(), generator=generator)
        conv.weight.add_(delta.reshape(conv.weight.shape) * 0.05)
        deltas[CONV] = delta.reshape(conv.weight.shape) * 0.05
    return save_full_diffusers(bundle, tmp_path / "tuned", "fp32"), deltas


@pytest.mark.slow
@pytest.mark.parametrize("fmt,conv", [("peft", False), ("kohya", True)])
def test_extract_recovers_a_low_rank_change_and_loads_back(tandem_home, tmp_path, fmt, conv):
    """Linear layers always, a convolution with `conv` (the kohya file: ComfyUI's and sd-scripts' LoCon)."""
    tuned, deltas = _fine_tune(tmp_path, rank=3)
    report = extract("builtin:demo", str(tuned), tmp_path / "extracted.safetensors", rank=5, alpha=2.0, fmt=fmt,
                     dtype="fp32", conv=conv, device="cpu")
    assert report.text_encoders == []  # the text encoder was not changed
    assert report.too_small == (["conv_out"] if conv else [])  # its 4 output channels cannot hold rank 5
    if not conv:
        deltas[CONV] = torch.zeros_like(deltas.pop(CONV))
    kept = {layer.module.removeprefix("unet."): layer.kept for layer in report.layers}
    assert (CONV in kept) == conv
    for path in deltas:
        assert kept.get(path, 1.0) == pytest.approx(1.0, abs=1e-6)
    with safe_open(report.output, "pt") as f:
        metadata = f.metadata()
    assert metadata["ss_network_dim"] == "5" and metadata["tandem_extracted_from"] == "tuned"

    base, loaded = _pipeline(), _fused(report.output)
    changes = {path: loaded.unet.state_dict()[path + ".weight"] - base.unet.state_dict()[path + ".weight"]
               for path in deltas}
    for path, delta in deltas.items():
        torch.testing.assert_close(changes[path], delta, rtol=0, atol=2e-5)
    untouched = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k.weight"
    torch.testing.assert_close(loaded.unet.state_dict()[untouched], base.unet.state_dict()[untouched], rtol=0, atol=1e-6)
    # Tandem reads it back as the LoRA it would start a run from.
    from modules.model.lora_reading import adapter_settings, read_lora
    assert adapter_settings(read_lora(report.output, load_model(ModelConfig())))["lora_rank"] == 5


# ------------------------------------------------------------------------------ bad input


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


@pytest.mark.slow
def test_bad_input_gets_one_line_naming_the_file_and_the_fix(tandem_home, tmp_path):
    lora = _random_lora(tmp_path, "kohya", rank=4, text=False)
    existing = tmp_path / "exists.safetensors"
    existing.write_bytes(b"x")
    with pytest.raises(ToolError) as error:
        resize(lora, existing, rank=2)
    assert str(existing) in _one_line(error) and "--overwrite" in str(error.value)
    (tmp_path / "merged-before").mkdir()  # a merge's folder too, refused before anything is loaded
    with pytest.raises(ToolError) as error:
        merge("builtin:demo", lora, tmp_path / "merged-before", device="cpu")
    assert str(tmp_path / "merged-before") in _one_line(error) and "--overwrite" in str(error.value)
    with pytest.raises(ToolError) as error:
        resize(lora, tmp_path / "bigger.safetensors", rank=8)
    assert "--rank 4 or less" in _one_line(error)
    with pytest.raises(ToolError) as error:
        resize(lora, tmp_path / "out.safetensors", rank=2, device="abacus")
    assert "--device 'abacus' is no device" in _one_line(error)
    if not torch.cuda.is_available():
        with pytest.raises(ToolError) as error:
            merge("builtin:demo", lora, tmp_path / "merged", device="cuda")
        assert "use --device cpu" in _one_line(error)

    not_lora = tmp_path / "model.safetensors"
    save_file({"conv_in.weight": torch.zeros(2, 2)}, not_lora)
    with pytest.raises(ToolError) as error:
        resize(not_lora, tmp_path / "out.safetensors", rank=2)
    assert str(not_lora) in _one_line(error) and "not a LoRA" in str(error.value)
    with pytest.raises(ToolError) as error:
        merge("builtin:demo", not_lora, tmp_path / "merged", device="cpu")
    assert str(not_lora) in _one_line(error)
    text_file = tmp_path / "notes.safetensors"
    text_file.write_text("hello")
    with pytest.raises(ToolError) as error:
        resize(text_file, tmp_path / "out.safetensors", rank=2)
    assert "not a .safetensors LoRA" in _one_line(error)

    # A LoRA of another base model: the demo UNet's layers renamed, as a kohya file of another model names them.
    tensors = load_file(lora)
    foreign = tmp_path / "foreign.safetensors"
    save_file({k.replace("lora_unet_down_blocks_0", "lora_unet_input_blocks_9"): v for k, v in tensors.items()}, foreign)
    with pytest.raises(ToolError) as error:
        merge("builtin:demo", foreign, tmp_path / "merged", device="cpu")
    assert str(foreign) in _one_line(error) and "another base model" in str(error.value)

    with pytest.raises(ToolError) as error:
        extract("builtin:demo", "builtin:demo", tmp_path / "x.safetensors", rank=100000, device="cpu")
    assert "--rank" in _one_line(error) and "or less" in str(error.value)
    with pytest.raises(ToolError) as error:
        extract("builtin:demo", str(tmp_path / "missing"), tmp_path / "x.safetensors", rank=2, device="cpu")
    assert "missing" in _one_line(error)


@pytest.mark.slow
def test_script_prints_one_line_and_exits_2(tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"")
    missing = tmp_path / "missing.safetensors"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "lora_tools.py"), "resize", "--lora", str(missing),
                             "--out", str(tmp_path / "new.safetensors"), "--rank", "2"],
                            capture_output=True, text=True, env={**os.environ, "TANDEM_EVENTS": "1"}, timeout=patience(300))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and str(missing) in result.stderr
    assert parse_tool_line(result.stdout.strip())["type"] == "error"


def test_tool_lines_round_trip():
    line = tool_line("progress", done=3, total=9, what="merging")
    assert parse_tool_line(line) == {"type": "progress", "done": 3, "total": 9, "what": "merging"}
    assert parse_tool_line("just log text") is None
    assert parse_tool_line("@tandem-tool {\"type\": \"progress\"}") is None
    assert parse_tool_line('@tandem-tool {"type": ["progress"]}') is None
    assert parse_tool_line('@tandem-tool {"type": "other"}') is None
    with pytest.raises(ValueError):
        tool_line("progress", done=1)


# ------------------------------------------------------------------------------ the GUI's Tools tab


FAKE_TOOL = """
import sys, time
sys.path.insert(0, {repo!r})
from modules.util.tool_lines import tool_line
if {fail!r}:
    print(tool_line("error", text={error!r}), flush=True)
    sys.exit(2)
for done in range(1, 4):
    print(tool_line("progress", done=done, total=3, what="merging"), flush=True)
    time.sleep({pause!r})
print("some log text")
print(tool_line("result", text="Merged 3 layers at strength 1 into out"), flush=True)
"""


def _fake_tool(tmp_path: Path, fail: bool = False, pause: float = 0.05,
               error: str = "x.safetensors: no such file; choose the LoRA's .safetensors file") -> Path:
    script = tmp_path / ("failing.py" if fail else "tool.py")
    script.write_text(FAKE_TOOL.format(repo=str(REPO), fail=fail, pause=pause, error=error))
    return script


def _wait(controller, seconds: float = 30):
    import time

    deadline = time.monotonic() + patience(seconds)
    while controller.poll().running and time.monotonic() < deadline:
        time.sleep(0.02)
    return controller.state


def test_controller_builds_the_script_command_and_refuses_missing_fields():
    from ui.lora_tools import LoraToolsController

    controller = LoraToolsController(python="py")
    command = controller.command("merge", {"lora": "a.safetensors", "out": "merged", "strength": "0.5",
                                           "overwrite": "1", "device": "auto"})
    assert command[1:] == [str(REPO / "scripts" / "lora_tools.py"), "merge", "--base-model", "builtin:demo",
                           "--lora", "a.safetensors", "--out", "merged", "--strength", "0.5", "--dtype", "fp16",
                           "--overwrite"]
    assert controller.start("merge", {"lora": "", "out": "merged"}).startswith("LoRA: fill it in")
    assert not controller.state.running and controller.state.line().startswith("LoRA:")
    with pytest.raises(ValueError, match="New rank"):
        controller.command("resize", {"lora": "a", "out": "b", "rank": ""})
    with pytest.raises(ValueError, match="not a number"):
        controller.command("extract", {"tuned-model": "t", "out": "o", "rank": "many"})
    # The script takes every option the tab offers.
    from modules.model.lora_tools_cli import parser
    for tool in ("merge", "resize", "extract"):
        values = {"lora": "a", "out": "b", "tuned-model": "t", "energy": "0.9", "conv": "1", "alpha": "4"}
        parser().parse_args(controller.command(tool, values)[2:])


def test_controller_follows_the_tool_process(tmp_path):
    from ui.lora_tools import LoraToolsController

    controller = LoraToolsController(script=_fake_tool(tmp_path))
    assert controller.start("merge", {"lora": "a", "out": "b"}) == ""
    assert controller.state.running
    state = _wait(controller)
    assert not state.running and (state.done, state.total, state.what) == (3, 3, "merging")
    assert state.result.startswith("Merged 3 layers") and not state.error

    failing = LoraToolsController(script=_fake_tool(tmp_path, fail=True))
    failing.start("merge", {"lora": "a", "out": "b"})
    assert _wait(failing).error.startswith("x.safetensors: no such file")

    slow = LoraToolsController(script=_fake_tool(tmp_path, pause=30))
    slow.start("merge", {"lora": "a", "out": "b"})
    slow.stop()
    assert _wait(slow).error == "stopped"


@pytest.mark.slow
def test_tools_tab_shows_errors_as_a_line_and_runs_off_the_tk_thread(window, tmp_path, monkeypatch):
    from tests.gui.test_ui_widgets import pump
    from ui.lora_tools import LoraToolsController

    app, _ = window()
    app.tabs.set("Tools")
    view = app.lora_tools
    view.select("merge")
    view.values["merge"]["lora"].set("")  # as a new window has it (the window is the module's)
    view.run_button.invoke()  # no LoRA chosen
    assert view.result.text().startswith("LoRA: fill it in") and not app.crash_text()

    monkeypatch.setattr(view, "controller", LoraToolsController(script=_fake_tool(tmp_path, pause=0.3)))
    view.values["merge"]["lora"].set("a.safetensors")
    view.values["merge"]["out"].set(str(tmp_path / "merged"))
    view.run_button.invoke()
    assert view.run_button.cget("state") == "disabled" and view.controller.state.running
    # The window keeps drawing while the tool works: progress arrives through after().
    assert pump(app, lambda: 0 < view.progress.get() < 1, timeout=20)
    assert pump(app, lambda: not view.controller.state.running, timeout=20)
    pump(app, timeout=0.3)
    assert view.result.text().startswith("Merged 3 layers") and view.progress.get() == 1
    assert view.run_button.cget("state") == "normal" and not app.crash_text()
    # A refusal names the script's options as the tab labels them (the script's own refusal of an output that
    # exists: test_bad_input_gets_one_line_naming_the_file_and_the_fix).
    monkeypatch.setattr(view, "controller", LoraToolsController(script=_fake_tool(
        tmp_path, fail=True, error=f"{tmp_path / 'merged'} exists; pass --overwrite to replace it")))
    view.run_button.invoke()
    assert pump(app, lambda: not view.controller.state.running and view.controller.state.error, timeout=20), \
        view.controller.state
    pump(app, timeout=0.3)
    assert "exists" in view.result.text() and "'Replace output'" in view.result.text()


@pytest.mark.slow
def test_tools_tab_merges_the_demo_model(window, tandem_home, tmp_path):
    """The real script, started from the tab: the merged folder appears and the window never waited. (Its
    refusal of an output that exists, in the tab's words: the test before.)"""
    import time

    from tests.gui.test_ui_widgets import pump

    lora = _random_lora(tmp_path, "kohya", text=False)
    app, _ = window()
    app.tabs.set("Tools")
    view = app.lora_tools
    view.select("merge")
    view.values["merge"]["lora"].set(str(lora))
    view.values["merge"]["out"].set(str(tmp_path / "merged"))
    view.values["merge"]["device"].set("cpu")
    started = time.monotonic()
    view.run_button.invoke()
    assert time.monotonic() - started < patience(2), "Run must not wait for the tool"
    frames = 0

    def finished() -> bool:
        nonlocal frames
        frames += 1
        return not view.controller.state.running

    assert pump(app, finished, timeout=120)
    pump(app, timeout=0.3)
    assert frames > 5, "the window kept handling events while the merge ran"
    assert view.result.text().startswith("Merged ") and str(tmp_path / "merged") in view.result.text()
    assert (tmp_path / "merged" / "unet" / "diffusion_pytorch_model.safetensors").is_file()


def test_the_tab_imports_no_torch():
    """The GUI runs the tools as a process: its controller and view import neither torch nor the tools."""
    code = ("import sys; import ui.lora_tools, ui.views.lora_tools_view; "
            "print(sorted(m for m in ('torch', 'modules.model.lora_tools') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=patience(120))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_tools_tab_fits_the_smallest_window(window):
    """Every picker fits the window's minimum width; Run is reached by scrolling, as on the other tabs."""
    import customtkinter as ctk

    from tests.gui.test_ui_widgets import pump
    from ui.views.app import MIN_SIZE

    app, _ = window()
    app.geometry(f"{MIN_SIZE[0]}x{MIN_SIZE[1]}+0+0")
    app.tabs.set("Tools")
    view = app.lora_tools
    for tool in ("merge", "resize", "extract"):
        view.select(tool)
        view._parent_canvas.yview_moveto(0.0)
        pump(app, timeout=0.4)
        right = app.winfo_rootx() + app.winfo_width()
        assert app.winfo_width() == MIN_SIZE[0]
        buttons = [w for w in view.forms[tool].winfo_children() if isinstance(w, ctk.CTkButton)]
        assert buttons
        for button in buttons:
            assert button.winfo_rootx() + button.winfo_width() <= right, (tool, button.cget("text"))
        view._parent_canvas.yview_moveto(1.0)
        pump(app, timeout=0.4)
        bottom = app.winfo_rooty() + app.winfo_height()
        assert view.run_button.winfo_rooty() + view.run_button.winfo_height() <= bottom, tool


@pytest.mark.slow
def test_merge_and_extract_a_transformer_family(tandem_home, tmp_path):
    """Flux: a LoRA in the peft layout merges as W + alpha / rank x B @ A, diffusers' Flux transformer loads the
    merged folder, and extracting from merged and base gives the LoRA's changes back (the file Tandem reads)."""
    from diffusers import FluxTransformer2DModel

    from modules.model.lora_reading import read_lora

    bundle = load_model(ModelConfig(base_model="builtin:demo-flux"))
    params = add_lora(bundle, TrainingConfig(lora_rank=4, lora_alpha=2.0, lora_target_modules=["to_q", "to_v"]))
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in params:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    lora = save_lora(bundle, tmp_path / "flux.safetensors", "peft", "fp32")
    merged = merge("builtin:demo-flux", lora, tmp_path / "merged", dtype="fp32", device="cpu").output
    base = load_model(ModelConfig(base_model="builtin:demo-flux")).denoiser.state_dict()
    after = FluxTransformer2DModel.from_pretrained(merged, subfolder="transformer").state_dict()
    tensors = load_file(lora)
    changed = sorted(k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in tensors
                     if k.endswith(".lora_A.weight"))
    assert len(changed) > 4
    for path in changed:
        delta = 0.5 * tensors[f"transformer.{path}.lora_B.weight"] @ tensors[f"transformer.{path}.lora_A.weight"]
        torch.testing.assert_close(after[path + ".weight"], base[path + ".weight"] + delta, rtol=0, atol=1e-5)

    report = extract("builtin:demo-flux", str(merged), tmp_path / "back.safetensors", rank=4, fmt="peft",
                     dtype="fp32", device="cpu")
    weights = read_lora(report.output, load_model(ModelConfig(base_model="builtin:demo-flux")))
    state = weights.state["transformer"]
    scale = weights.alpha["transformer"] / weights.rank["transformer"]
    for path in changed:
        back = scale * state[f"{path}.lora_B.weight"] @ state[f"{path}.lora_A.weight"]
        torch.testing.assert_close(back, after[path + ".weight"] - base[path + ".weight"], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_extract_holding_the_models_in_bf16(tandem_home, tmp_path):
    """`load_dtype` bf16 (half the memory): the change comes back up to the models' own rounding."""
    tuned, deltas = _fine_tune(tmp_path, rank=3)
    report = extract("builtin:demo", str(tuned), tmp_path / "half.safetensors", rank=3, fmt="peft", dtype="fp32",
                     device="cpu", load_dtype="bf16")
    tensors = load_file(report.output)
    for path, delta in deltas.items():
        if path == CONV:
            continue
        back = tensors[f"unet.{path}.lora_B.weight"] @ tensors[f"unet.{path}.lora_A.weight"]
        assert (back - delta).norm() < 0.02 * delta.norm(), path
