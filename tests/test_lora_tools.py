"""The LoRA tools (merge, resize, extract; modules/model/lora_tools.py, lora_resize.py): what each writes is what
the math says and what diffusers makes of the same files, it loads back in diffusers, bad input gets one line,
and the GUI's Tools tab runs them without blocking the window."""
from __future__ import annotations

import json
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

REPO = Path(__file__).resolve().parents[1]
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
    return save_full_diffusers(bundle, tmp_path / "tuned", "fp32"), deltas


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["peft", "kohya"])
def test_extract_recovers_a_low_rank_change_and_loads_back(tandem_home, tmp_path, fmt):
    tuned, deltas = _fine_tune(tmp_path, rank=3)
    report = extract("builtin:demo", str(tuned), tmp_path / "extracted.safetensors", rank=4, alpha=2.0, fmt=fmt,
                     dtype="fp32", device="cpu")
    assert report.text_encoders == []  # the text encoder was not changed
    kept = {layer.module.removeprefix("unet."): layer.kept for layer in report.layers}
    for path in deltas:
        assert kept[path] == pytest.approx(1.0, abs=1e-6)
    with safe_open(report.output, "pt") as f:
        metadata = f.metadata()
    assert metadata["ss_network_dim"] == "4" and metadata["tandem_extracted_from"] == "tuned"

    base, loaded = _pipeline(), _fused(report.output)
    changes = {path: loaded.unet.state_dict()[path + ".weight"] - base.unet.state_dict()[path + ".weight"]
               for path in deltas}
    for path, delta in deltas.items():
        torch.testing.assert_close(changes[path], delta, rtol=0, atol=2e-5)
    untouched = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k.weight"
    torch.testing.assert_close(loaded.unet.state_dict()[untouched], base.unet.state_dict()[untouched], rtol=0, atol=1e-6)
    # Tandem reads it back as the LoRA it would start a run from.
    from modules.model.lora_reading import adapter_settings, read_lora
    assert adapter_settings(read_lora(report.output, load_model(ModelConfig())))["lora_rank"] == 4


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
    with pytest.raises(ToolError) as error:
        resize(lora, tmp_path / "bigger.safetensors", rank=8)
    assert "--rank 4 or less" in _one_line(error)

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


def test_script_prints_one_line_and_exits_2(tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"")
    missing = tmp_path / "missing.safetensors"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "lora_tools.py"), "resize", "--lora", str(missing),
                             "--out", str(tmp_path / "new.safetensors"), "--rank", "2"],
                            capture_output=True, text=True, env={**os.environ, "TANDEM_EVENTS": "1"}, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and str(missing) in result.stderr
    assert parse_tool_line(result.stdout.strip())["type"] == "error"


def test_tool_lines_round_trip():
    line = tool_line("progress", done=3, total=9, what="merging")
    assert parse_tool_line(line) == {"type": "progress", "done": 3, "total": 9, "what": "merging"}
    assert parse_tool_line("just log text") is None
    assert parse_tool_line("@tandem-tool {\"type\": \"progress\"}") is None
    with pytest.raises(ValueError):
        tool_line("progress", done=1)
