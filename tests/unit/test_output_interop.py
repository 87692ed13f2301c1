"""What saved files say about themselves and who reads them: no local paths in saved diffusers folders,
ModelSpec metadata in full single files (architecture naming the variant, as sd-scripts does), and SD3's
two LoRA layouts - the kohya file for ComfyUI and sd-scripts, the peft file for diffusers."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modules.config.train_config import ModelConfig
from modules.model import load_model, save_full_diffusers, save_full_single_file, save_lora
from modules.model.families import original_layout as layout
from tests.unit.test_dit_lora import ATTENTION, _pipeline, pipeline_text, prediction, trained_lora
from tests.unit.test_flux2_chroma_lora import comfy_lora_keys

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("base", ["builtin:demo", "builtin:demo-flux2"])
def test_saved_folders_name_no_local_path(tandem_home, tmp_path, base):
    """diffusers and transformers record the folder a component was loaded from (`_name_or_path`, an
    absolute path) in each config; a saved model leaves it out, and still loads."""
    bundle = load_model(ModelConfig(base_model=base))
    folder = save_full_diffusers(bundle, tmp_path / "out", "fp32")
    configs = [p for p in folder.rglob("*.json") if p.name != "tokenizer.json"]
    assert any(p.name == "config.json" for p in configs)
    for path in configs:
        text = path.read_text(encoding="utf-8")
        assert "name_or_path" not in text and str(tandem_home) not in text, path
    assert load_model(ModelConfig(base_model=str(folder))).model_type == bundle.model_type


@pytest.mark.parametrize("base,architecture,implementation", [
    ("builtin:demo", "stable-diffusion-v1", "https://github.com/Stability-AI/generative-models"),
    ("builtin:demo-sd3", "stable-diffusion-3-5-medium", "https://github.com/Stability-AI/generative-models"),
    ("builtin:demo-flux", "flux-1-dev", "https://github.com/black-forest-labs/flux"),
    ("builtin:demo-chroma", "chroma", "https://huggingface.co/lodestones/Chroma"),
    ("builtin:demo-flux2", "flux-2-dev", "https://github.com/black-forest-labs/flux2")])
def test_single_files_carry_modelspec(tandem_home, tmp_path, base, architecture, implementation):
    bundle = load_model(ModelConfig(base_model=base))
    path = save_full_single_file(bundle, tmp_path / "my-model.safetensors", "fp16",
                                 metadata={"modelspec.resolution": "512x512"})
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    assert metadata["modelspec.sai_model_spec"] == "1.0.1"
    assert (metadata["modelspec.architecture"], metadata["modelspec.implementation"]) == (architecture, implementation)
    assert metadata["modelspec.title"] == "my-model" and metadata["modelspec.resolution"] == "512x512"
    assert metadata["modelspec.date"] and metadata["tandem_model_type"] == bundle.model_type
    assert ("modelspec.prediction_type" in metadata) == (bundle.model_type == "sd1")
    assert not any(str(tandem_home) in value for value in metadata.values())


def test_sd3_modelspec_names_the_variant(tandem_home):
    """As sd-scripts: q/k norms and dual attention (SD3.5 Medium), q/k norms alone (3.5 Large), neither (SD3
    Medium); LoRAs add `/lora`."""
    from types import SimpleNamespace

    from modules.model.families import family

    sd3 = family("sd3")
    config = lambda **c: SimpleNamespace(denoiser=SimpleNamespace(config=c))  # noqa: E731
    assert sd3.modelspec_architecture(config(qk_norm="rms_norm", dual_attention_layers=[0, 1])) == \
        "stable-diffusion-3-5-medium"
    assert sd3.modelspec_architecture(config(qk_norm="rms_norm", dual_attention_layers=[])) == \
        "stable-diffusion-3-5-large"
    assert sd3.modelspec_architecture(config(qk_norm=None, dual_attention_layers=[])) == "stable-diffusion-3-medium"
    bundle = load_model(ModelConfig(base_model="builtin:demo-sd3"))
    assert sd3.lora_modelspec(bundle, "kohya")["modelspec.architecture"] == "stable-diffusion-3-5-medium/lora"


def test_sd3_kohya_file_is_for_comfyui_and_the_peft_file_for_diffusers(tandem_home, tmp_path):
    """`StableDiffusion3Pipeline.load_lora_weights` reads no sd-scripts layout (diffusers 0.42 has no converter
    for SD3): it applies nothing of the kohya file - which is why SD3 presets write both files and
    docs/Models.md says which tool reads which. Every module of the kohya file is a name ComfyUI maps to a
    weight of the same shape; the peft file gives the trained model's output in diffusers."""
    bundle = trained_lora("sd3", ATTENTION, text_encoder=False)
    kohya_path = save_lora(bundle, tmp_path / "lora.safetensors", "kohya", "fp32")
    peft_path = save_lora(bundle, tmp_path / "lora.peft.safetensors", "peft", "fp32")
    _, expected = prediction(bundle, bundle.denoiser)

    pipeline = _pipeline("sd3")
    _, before = prediction(bundle, pipeline.transformer, pipeline_text("sd3", pipeline))
    pipeline.load_lora_weights(str(kohya_path))
    _, after = prediction(bundle, pipeline.transformer, pipeline_text("sd3", pipeline))
    assert torch.equal(before, after), "diffusers now reads SD3 kohya files: update docs/Models.md"

    pipeline = _pipeline("sd3")
    pipeline.load_lora_weights(str(peft_path))
    _, out = prediction(bundle, pipeline.transformer, pipeline_text("sd3", pipeline))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)

    base = {k.replace(".base_layer", ""): v for k, v in bundle.denoiser.state_dict().items() if ".lora_" not in k}
    original = layout.to_original(base, bundle.family.layout(bundle.denoiser.config, base))
    accepted = comfy_lora_keys(original)
    kohya = load_file(str(kohya_path))
    modules = {k.removesuffix(".lora_down.weight") for k in kohya if k.endswith(".lora_down.weight")}
    assert modules and modules <= set(accepted)
    for module in modules:
        assert (kohya[f"{module}.lora_up.weight"].shape[0], kohya[f"{module}.lora_down.weight"].shape[1]) == \
            accepted[module]
    with safe_open(str(kohya_path), "pt") as f:
        assert json.loads(json.dumps(f.metadata()))["modelspec.architecture"] == "stable-diffusion-3-5-medium/lora"
