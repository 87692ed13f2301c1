"""Which program applies which LoRA file (`modules/model/lora_clients.py`), checked against the programs: ComfyUI
by its loader's rules (`tests/comfy_lora_rules.py`, alpha from `.alpha` tensors only), diffusers 0.42.1 by
loading the files into the family's pipeline. `scripts/convert_lora.py --for comfyui|diffusers` makes a file
the chosen program applies exactly, and every saved file's log line says who reads it."""
from __future__ import annotations

import runpy
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from modules.families.registry import FAMILIES
from modules.config.train_config import ModelConfig, TrainingConfig
from modules.model import add_lora, load_model, save_lora
from modules.model.lora import lora_modules
from modules.families.lora_clients import EXACT, NOTHING, WRONG, comfyui_reading, diffusers_reading, layout_for, save_note
from modules.model.lora_convert import convert_lora_file
from modules.model.lora_reading import apply_lora, read_lora
from tests import comfy_lora_rules as comfy
from tests.trainer_helpers import tandem_log

pytestmark = pytest.mark.usefixtures("one_torch_thread")
RANK, ALPHA = 4, 8.0
BASES = {"sd1": "builtin:demo", "sd3": "builtin:demo-sd3", "flux": "builtin:demo-flux", "chroma": "builtin:demo-chroma",
         "flux2": "builtin:demo-flux2", "qwen": "builtin:demo-qwen", "zimage": "builtin:demo-zimage",
         "wan": "builtin:demo-wan", "lumina2": "builtin:demo-lumina2", "qwen_image21": "builtin:demo-qwen_image21",
         "flux3": "builtin:demo-flux3"}
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
TARGETS = {"sd1": ATTENTION + ["proj_in"],  # proj_in: a 1x1 convolution
           "sdxl": ATTENTION + ["proj_in", "ff.net.2"],
           "flux": ATTENTION + ["add_q_proj", "proj_mlp", "proj_out"],  # proj_mlp: a slice of linear1
           "zimage": ATTENTION + ["feed_forward.w1"],  # to_q/k/v: slices of the fused qkv
           "qwen_image21": ATTENTION + ["img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out"]}  # halves of gate_up


@pytest.fixture(scope="module")
def sdxl_source(tandem_home, tmp_path_factory):
    from tests.integration.test_model_types_training import write_sources

    return str(write_sources("sdxl", tmp_path_factory.mktemp("tiny_sdxl"))["folder"])


def adapted(base_model: str, name: str, lora_type: str, seed: int = 0):
    """The family's demo with `lora_type` adapters (rank 4, alpha 8) of random weights; SD's text encoders too."""
    bundle = load_model(ModelConfig(base_model=base_model))
    targets = TARGETS.get(name) or list(FAMILIES[name].lora_targets) or ATTENTION
    add_lora(bundle, TrainingConfig(lora_type=lora_type, lora_rank=RANK, lora_alpha=ALPHA, precision="fp32",
                                    lora_target_modules=targets, train_text_encoder=name in ("sd1", "sdxl")))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in bundle.modules().values():
            for key, param in module.named_parameters():
                if param.requires_grad:
                    noise = torch.randn(param.shape, generator=generator) * 0.2
                    param.copy_(param.abs() + noise.abs() if "magnitude" in key else noise)
    for module in bundle.modules().values():
        module.eval()
    return bundle


def comfy_verdict(model: comfy.ComfyModel, expected: dict, lora: dict) -> tuple[str, list[str]]:
    """What ComfyUI's rules make of `lora`: exact, wrong or nothing, and the keys it leaves unloaded."""
    patched, left = model.apply(lora)
    changed = [k for k in expected if not torch.equal(expected[k], model.state[k])]
    assert changed, "the adapters change nothing: the comparison is vacuous"
    if all(torch.equal(patched[k], model.state[k]) for k in changed):
        return NOTHING, left
    exact = all(torch.allclose(patched[k], expected[k], atol=2e-5, rtol=1e-4) for k in expected)
    return (EXACT if exact and not left else WRONG), left


COMFY_CASES = [*((name, "lora") for name in ("sd1", "sdxl", "sd3", "flux", "chroma", "flux2", "qwen", "zimage", "wan",
                                              "lumina2", "qwen_image21")),
               *((name, t) for name in ("qwen", "zimage", "wan") for t in ("dora", "loha", "lokr")),
               ("sd3", "dora"), ("chroma", "loha"), ("flux2", "lokr"), ("qwen_image21", "lokr")]
"""Plain LoRA of every family; the variants where their names are each family's own (SD1's and Flux's variants:
tests/unit/test_lora_variants.py), and one variant of each other transformer family for what ComfyUI makes of its
peft file."""
CONVERTED = {("sd1", "lora"), ("zimage", "lora"), ("sd3", "dora"), ("qwen", "loha"), ("wan", "lokr")}
"""The cases converted from the peft file with `--for comfyui` too: text encoders, fused slices, DoRA's
`dora_scale`, each family's LyCORIS names."""


@pytest.mark.slow
@pytest.mark.parametrize("name,lora_type", COMFY_CASES)
def test_what_comfyui_makes_of_each_file_is_what_tandem_says(sdxl_source, tmp_path, name, lora_type):
    """Both layouts of every family (variants where they apply) through ComfyUI's loader: what it does is what
    `lora_clients` says, the kohya file is applied exactly, and a peft file converted `--for comfyui` too."""
    base_model = sdxl_source if name == "sdxl" else BASES[name]
    bundle = adapted(base_model, name, lora_type)
    model = comfy.comfy_model(bundle)
    expected = model.place(comfy.trained_weights(bundle))
    files = {fmt: save_lora(bundle, tmp_path / f"{fmt}.safetensors", fmt, "fp32") for fmt in ("kohya", "peft")}
    for fmt, path in files.items():
        verdict, left = comfy_verdict(model, expected, load_file(str(path)))
        assert verdict == comfyui_reading(name, lora_type, fmt, ALPHA, RANK).verdict, (fmt, verdict, left[:3])
    assert comfy_verdict(model, expected, load_file(str(files["kohya"]))) == (EXACT, [])
    if (name, lora_type) in CONVERTED:
        converted = convert_lora_file(files["peft"], tmp_path / "for-comfyui.safetensors", base_model, dtype="fp32",
                                      client="comfyui")
        assert comfy_verdict(model, expected, load_file(str(converted))) == (EXACT, [])


@pytest.mark.slow
def test_comfyui_applies_a_peft_file_at_alpha_over_rank_one(tandem_home, tmp_path):
    """The strength ComfyUI gives a peft file (its alpha only in the header): alpha / rank = 1, so rank 4 and
    alpha 8 land at half strength; the file converted for ComfyUI lands exactly."""
    bundle = adapted(BASES["qwen"], "qwen", "lora")
    model = comfy.comfy_model(bundle)
    trained = comfy.trained_weights(bundle)
    peft = load_file(str(save_lora(bundle, tmp_path / "peft.safetensors", "peft", "fp32")))
    patched, left = model.apply(peft)
    assert left == []
    half = model.place({k: (v + bundle_base(bundle, k)) / 2 for k, v in trained.items()})
    for key in half:
        torch.testing.assert_close(patched[key], half[key], rtol=0, atol=1e-5, msg=key)
    converted = convert_lora_file(tmp_path / "peft.safetensors", tmp_path / "comfy.safetensors", BASES["qwen"],
                                  dtype="fp32", client="comfyui")
    assert comfy_verdict(model, model.place(trained), load_file(str(converted))) == (EXACT, [])


def bundle_base(bundle, key: tuple[str, str]) -> torch.Tensor:
    component, name = key
    layer = bundle.modules()[component].get_submodule(name.removesuffix(".weight"))
    return layer.get_base_layer().weight.detach().double()


# ------------------------------------------------------------------ diffusers


def diffusers_verdict(base_model: str, path, bundle) -> str:
    """What diffusers' `load_lora_weights` + `fuse_lora` make of the file: exact, wrong or nothing (an error
    counts as nothing: no weight is applied)."""
    fresh = load_model(ModelConfig(base_model=base_model))
    pipeline = fresh.family.pipeline(fresh)
    denoiser = getattr(pipeline, "transformer", None) or pipeline.unet
    before = {k: v.clone() for k, v in denoiser.state_dict().items()}
    expected = {name: weight for (component, name), weight in comfy.trained_weights(bundle).items()
                if component == bundle.denoiser_name}
    try:
        pipeline.load_lora_weights(str(path))
        pipeline.fuse_lora()
    except (ValueError, KeyError, AssertionError, RuntimeError) as error:
        if type(error).__name__ not in ("ValueError", "KeyError", "AssertionError", "NoMatchingPeftModuleError"):
            raise
        return NOTHING
    after = {k.replace(".base_layer", ""): v for k, v in denoiser.state_dict().items() if "lora_" not in k}
    if all(torch.equal(after[k], before[k]) for k in expected):
        return NOTHING
    exact = all(torch.allclose(after[k].double(), expected[k], atol=2e-5, rtol=1e-4) for k in expected)
    return EXACT if exact else WRONG


DIFFUSERS_CASES = [("sd1", "loha", "kohya"), ("sd1", "loha", "peft"), ("sd3", "lora", "kohya"),
                   ("flux2", "lokr", "peft"), ("flux2", "dora", "kohya"), ("zimage", "lokr", "peft"),
                   ("qwen", "lokr", "peft"), ("qwen", "loha", "kohya"), ("wan", "lokr", "kohya"),
                   ("lumina2", "lora", "kohya"), ("lumina2", "lokr", "peft"), ("qwen_image21", "lora", "kohya"),
                   ("qwen_image21", "lokr", "peft"), ("flux3", "lora", "kohya"), ("flux3", "dora", "peft"),
                   ("flux3", "lokr", "peft")]
"""SD's kohya DoRA file: test_a_kohya_dora_file_converted_for_diffusers_loads_exactly."""


@pytest.mark.slow
@pytest.mark.parametrize("name,lora_type,fmt", DIFFUSERS_CASES)
def test_what_diffusers_makes_of_each_file_is_what_tandem_says(tandem_home, tmp_path, name, lora_type, fmt):
    """The cells of `lora_clients`' diffusers table that other tests do not load already (plain LoRA and DoRA
    peft files of every family: test_lora_variants, test_dit_lora, test_flux2_chroma_lora, test_qwen_zimage)."""
    bundle = adapted(BASES[name], name, lora_type)
    path = save_lora(bundle, tmp_path / f"{fmt}.safetensors", fmt, "fp32")
    assert diffusers_verdict(BASES[name], path, bundle) == diffusers_reading(name, lora_type, fmt).verdict


@pytest.mark.slow
def test_a_kohya_dora_file_converted_for_diffusers_loads_exactly(tandem_home, tmp_path):
    """diffusers drops an SD kohya file's `dora_scale` (a plain LoRA is left); `--for diffusers` writes the peft
    layout, with the magnitudes it reads."""
    bundle = adapted(BASES["sd1"], "sd1", "dora")
    kohya = save_lora(bundle, tmp_path / "dora.safetensors", "kohya", "fp32")
    assert diffusers_verdict(BASES["sd1"], kohya, bundle) == WRONG
    converted = convert_lora_file(kohya, tmp_path / "dora.diffusers.safetensors", BASES["sd1"], dtype="fp32",
                                  client="diffusers")
    assert diffusers_verdict(BASES["sd1"], converted, bundle) == EXACT


# ------------------------------------------------------------------ the table, the note, the script


def test_each_client_gets_the_layout_it_applies_exactly():
    for name in FAMILIES:
        for lora_type in ("lora", "dora", "loha", "lokr"):
            if name == "lumina2" and lora_type != "lora":  # its LyCORIS adapters of q, k, v have no ComfyUI name
                with pytest.raises(ValueError, match="ComfyUI applies no .* of a lumina2 model.*all but its adapters"):
                    layout_for("comfyui", name, lora_type)
            elif name == "flux3":  # ComfyUI has no Flux.3 model
                with pytest.raises(ValueError, match="ComfyUI applies no .* of a flux3 model.*no Flux.3 model"):
                    layout_for("comfyui", name, lora_type)
            else:
                assert layout_for("comfyui", name, lora_type) == "kohya"
            if lora_type == "loha" or (lora_type == "lokr" and name not in ("flux2", "zimage")):
                with pytest.raises(ValueError, match="diffusers reads no Lo"):
                    layout_for("diffusers", name, lora_type)
            else:
                assert layout_for("diffusers", name, lora_type) == "peft"
    # alpha == rank: the peft file is exact in ComfyUI too (where it maps the names at all)
    assert comfyui_reading("flux", "lora", "peft", 4.0, 4).verdict == EXACT
    assert comfyui_reading("wan", "lora", "peft", 4.0, 4).verdict == NOTHING
    assert comfyui_reading("flux", "dora", "peft", 4.0, 4).verdict == WRONG


def test_the_save_note_names_who_reads_the_file_and_what_to_use_elsewhere():
    note = save_note("/out/style.peft.safetensors", "flux", "lora", "peft", ALPHA, RANK, "/models/flux1-dev")
    assert note.startswith("style.peft.safetensors (peft layout, LoRA): ComfyUI applies it at alpha / rank = 1 "
                           "instead of 2")
    assert "diffusers applies it exactly" in note and "\n" not in note
    assert ("python scripts/convert_lora.py /out/style.peft.safetensors /out/style.comfyui.safetensors "
            "--base-model /models/flux1-dev --for comfyui") in note
    both = save_note("/out/style.peft.safetensors", "flux", "lora", "peft", ALPHA, RANK, "m",
                     {"kohya": "/out/style.safetensors"})
    assert both.endswith("for ComfyUI use style.safetensors; diffusers applies it exactly")
    loha = save_note("/out/s.safetensors", "sd3", "loha", "kohya", ALPHA, RANK, "m")
    assert loha == ("s.safetensors (kohya layout, LoHa): ComfyUI applies it exactly; diffusers applies nothing of it "
                    "(it reads no LyCORIS LoHa names: an error or a silent no-op); diffusers reads no LoHa file of "
                    "this family")
    sd3 = save_note("/out/s.safetensors", "sd3", "lora", "kohya", ALPHA, RANK, "m")
    assert "diffusers applies nothing of it, silently" in sd3 and "--for diffusers" in sd3


@pytest.mark.slow
def test_convert_script_writes_for_a_client_and_refuses_what_it_cannot(tandem_home, tmp_path, monkeypatch, capsys):
    bundle = adapted(BASES["qwen"], "qwen", "loha")
    source = save_lora(bundle, tmp_path / "loha.safetensors", "peft", "fp32")
    script = "scripts/convert_lora.py"

    def run(*args):
        monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
        runpy.run_path(script, run_name="__main__")

    run(source, tmp_path / "comfy.safetensors", "--base-model", BASES["qwen"], "--for", "comfyui", "--dtype", "fp32")
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("comfy.safetensors") and "ComfyUI applies it exactly" in out[1]
    assert all(k.startswith("lycoris_") for k in load_file(str(tmp_path / "comfy.safetensors")))
    with pytest.raises(SystemExit, match="diffusers reads no LoHa file of a qwen model in any layout"):
        run(source, tmp_path / "diffusers.safetensors", "--base-model", BASES["qwen"], "--for", "diffusers")
    assert not (tmp_path / "diffusers.safetensors").exists()


@pytest.mark.slow
def test_variant_files_of_earlier_versions_still_read(tandem_home, tmp_path):
    """Qwen-Image's, Z-Image's and Wan's LyCORIS modules were `lora_transformer_<diffusers path>` before they took
    the names ComfyUI maps for them; such files still read back to the same adapters."""
    bundle = adapted(BASES["qwen"], "qwen", "loha")
    new = load_file(str(save_lora(bundle, tmp_path / "new.safetensors", "kohya", "fp32")))
    assert all(k.startswith("lycoris_") for k in new)
    save_file({"lora_transformer_" + k.removeprefix("lycoris_"): v.contiguous() for k, v in new.items()},
              tmp_path / "old.safetensors")
    fresh = adapted(BASES["qwen"], "qwen", "loha", seed=5)
    apply_lora(fresh, read_lora(tmp_path / "old.safetensors", fresh))
    for key, value in lora_modules(bundle)["transformer"].items():
        torch.testing.assert_close(lora_modules(fresh)["transformer"][key], value, rtol=0, atol=0)



def test_the_trainer_logs_who_reads_each_file(tmp_path):
    """`OutputWriter._say_who_reads`: one line per file, the other file named where it is the one to use."""
    from types import SimpleNamespace

    from modules.trainer.outputs import OutputWriter

    bundle = SimpleNamespace(model_type="flux", denoiser=None)
    fake = SimpleNamespace(parts=SimpleNamespace(bundle=bundle, cfg=SimpleNamespace(
        model=SimpleNamespace(base_model="builtin:demo-flux"))))
    files = {"kohya": tmp_path / "s.safetensors", "peft": tmp_path / "s.peft.safetensors"}
    import modules.model.lora as lora

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lora, "lora_alpha_and_rank", lambda b: (ALPHA, RANK))
        patch.setattr(lora, "lora_type", lambda b: "lora")
        with tandem_log() as lines:
            OutputWriter._say_who_reads(fake, files)
    assert lines == [
        "s.safetensors (kohya layout, LoRA): ComfyUI applies it exactly; diffusers applies it exactly",
        "s.peft.safetensors (peft layout, LoRA): ComfyUI applies it at alpha / rank = 1 instead of 2 (it reads alpha "
        "from `.alpha` tensors only, and this file has alpha in its header); for ComfyUI use s.safetensors; "
        "diffusers applies it exactly"]


# ------------------------------------------------------------------ the GUI


def test_the_save_tab_line_says_who_reads_the_files_the_config_writes():
    from modules.config import TrainConfig, apply_overrides
    from ui.lora_readers import lora_readers_text

    def text(*overrides):
        return lora_readers_text(apply_overrides(TrainConfig(), list(overrides)))

    assert text("training.method=full") == ""
    assert text("model.base_model=builtin:demo-flux", "save.lora_format=kohya") == (
        "The kohya file: ComfyUI applies it exactly; diffusers applies it exactly.")
    peft = text("model.base_model=builtin:demo-flux", "save.lora_format=peft", "training.lora_rank=16",
                "training.lora_alpha=8")
    assert peft.startswith("The peft file: ComfyUI applies it at alpha / rank = 1 instead of 0.5")
    assert peft.endswith("For ComfyUI choose kohya or both "
                         "(scripts/convert_lora.py --for comfyui converts a saved file).")
    loha = text("model.base_model=builtin:demo-flux2", "save.lora_format=both", "training.lora_type=loha")
    assert "The peft file: " in loha and loha.endswith("diffusers reads no file of this LoRA type.")
    assert "diffusers reads" not in text("model.base_model=builtin:demo-flux2", "save.lora_format=both",
                                         "training.lora_type=lokr")  # diffusers loads Flux.2's peft LoKr
    assert "depends on the model family" in text("model.base_model=/nowhere/model.ckpt")


@pytest.mark.slow
def test_the_save_tab_shows_the_line_and_keeps_it_current(display, tmp_path):
    from tests.gui.test_ui_widgets import make_app, pump

    app, _ = make_app(tmp_path)
    try:
        assert app.load("#demo")
        app.binder.fields["training.method"].var.set("lora")
        app.binder.fields["save.lora_format"].var.set("kohya")
        pump(app)
        line = app.binder.lora_readers_line
        assert line.cget("text").startswith("The kohya file: ComfyUI applies it exactly")
        app.binder.fields["save.lora_format"].var.set("peft")
        pump(app)
        assert "For ComfyUI choose kohya or both" in line.cget("text")
        app.binder.fields["training.method"].var.set("full")
        pump(app)
        assert line.cget("text") == "" and not line.winfo_ismapped()
    finally:
        app.controller.terminate()
        app.destroy()
