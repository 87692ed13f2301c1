"""SD3 and Flux LoRA files: the peft layout through diffusers' `load_lora_weights`, and the kohya layout
(original module names, q/k/v fused as the original checkpoints have them) as ComfyUI applies it."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from modules.util.batch_slice import BatchSlice
from modules.config.train_config import ModelConfig, TrainingConfig
from modules.model import add_lora, load_model, save_lora
from modules.model.families import original_layout as layout
from modules.model.families.dit_demo import ensure_dit_demo
from modules.model.lora import lora_modules

FAMILIES = ("sd3", "flux")
CAPTIONS = ["a red circle on a blue background", "a white triangle"]
RANK, ALPHA = 4, 8.0
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
# Flux's single blocks fuse q, k, v with the MLP input (`linear1`); `proj_mlp` left out gives zero rows there.
FLUX_TARGETS = ATTENTION + ["ff.net.0.proj", "ff_context.net.2", "norm1.linear", "proj_out"]
# Double blocks only: what diffusers' kohya reader handles below the real width (it assumes 3072 in single blocks).
FLUX_DOUBLE_BLOCK_TARGETS = [f"transformer_blocks.{i}.{m}" for i in range(2) for m in
                             ATTENTION + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "norm1.linear"]]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def trained_lora(name: str, targets: list[str], text_encoder: bool = True):
    """The demo model with LoRA (rank 4, alpha 8) on `targets` and the CLIP encoders, weights moved off zero."""
    bundle = load_model(ModelConfig(base_model=f"builtin:demo-{name}", t5_max_length=24))
    params = add_lora(bundle, TrainingConfig(lora_rank=RANK, lora_alpha=ALPHA, lora_target_modules=targets,
                                             train_text_encoder=text_encoder))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in params:
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    for module in bundle.modules().values():
        module.eval()
    return bundle


def prediction(bundle, transformer, text_encoders=None):
    """Text conditioning and transformer output for fixed inputs; `transformer`/`text_encoders` may be
    a pipeline's (the text is encoded through the pipeline's own encode_prompt then)."""
    objective = bundle.family.objective(bundle, TrainingConfig())
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 16, 8, 8, generator=generator)
    draw = objective.draw(tuple(latents.shape), 5, 0, 0, BatchSlice(0, latents.shape[0], latents.shape[0]),
                          torch.device("cpu"))
    with torch.no_grad():
        text = bundle.encode_text(CAPTIONS) if text_encoders is None else text_encoders(CAPTIONS)
        out = objective.predict(transformer, objective.noisy(latents, draw), draw.timesteps, text)
    # Both text outputs, flattened side by side (Flux's CLIP reaches only the pooled vector).
    return torch.cat([text["encoder_hidden_states"].flatten(1), text["pooled"].flatten(1)], dim=1), out


def pipeline_text(name, pipeline):
    def encode(captions):
        if name == "sd3":
            embeds, _, pooled, _ = pipeline.encode_prompt(captions, captions, captions, device="cpu",
                                                          do_classifier_free_guidance=False, max_sequence_length=24)
        else:
            embeds, pooled, _ = pipeline.encode_prompt(captions, captions, device="cpu", max_sequence_length=24)
        return {"encoder_hidden_states": embeds, "pooled": pooled}
    return encode


def _pipeline(name):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    cls = {"sd3": StableDiffusion3Pipeline, "flux": FluxPipeline}[name]
    return cls.from_pretrained(ensure_dit_demo(name), local_files_only=True)


@pytest.mark.parametrize("name", FAMILIES)
def test_peft_file_loads_in_diffusers_with_the_same_output(tandem_home, tmp_path, name):
    bundle = trained_lora(name, FLUX_TARGETS if name == "flux" else ATTENTION + ["ff.net.0.proj"])
    path = save_lora(bundle, tmp_path / "lora.safetensors", "peft", "fp32")
    expected_text, expected = prediction(bundle, bundle.denoiser)

    pipeline = _pipeline(name)
    base_text, base = prediction(bundle, pipeline.transformer, pipeline_text(name, pipeline))
    pipeline.load_lora_weights(str(path))
    text, out = prediction(bundle, pipeline.transformer, pipeline_text(name, pipeline))
    torch.testing.assert_close(text, expected_text, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(base, expected, atol=1e-4), "the LoRA changed nothing: the comparison is vacuous"
    assert not torch.allclose(base_text, expected_text, atol=1e-4), "the text-encoder LoRA changed nothing"


def _base_state(module) -> dict:
    """The frozen weights under a LoRA-carrying module, by their plain names."""
    return {k.replace(".base_layer", ""): v for k, v in module.state_dict().items() if ".lora_" not in k}


def _merged_state(module, scale: float) -> dict:
    """The frozen weights with every adapter merged in (W + scale * B A), by plain names."""
    state = _base_state(module)
    for name, child in module.named_modules():
        if hasattr(child, "lora_A") and "default" in child.lora_A:
            delta = child.lora_B["default"].weight @ child.lora_A["default"].weight
            state[f"{name}.weight"] = state[f"{name}.weight"] + scale * delta
    return state


@pytest.mark.parametrize("name", FAMILIES)
def test_kohya_file_applied_to_the_original_weights_is_the_trained_model(tandem_home, tmp_path, name):
    """What ComfyUI does with a kohya LoRA - W_original += alpha / rank * up @ down for each module - gives
    exactly the original-layout weights of the LoRA-merged model; and the file reads back to the adapters."""
    bundle = trained_lora(name, FLUX_TARGETS if name == "flux" else ATTENTION + ["ff.net.0.proj"])
    path = save_lora(bundle, tmp_path / "lora.safetensors", "kohya", "fp32")
    kohya = load_file(str(path))
    transformer = bundle.denoiser
    base, merged = _base_state(transformer), _merged_state(transformer, ALPHA / RANK)
    shapes = {k: v.shape for k, v in base.items()}
    entries = bundle.family.layout(transformer.config, shapes)
    applied = layout.to_original(base, entries)
    unet_modules = {k.removesuffix(".lora_down.weight") for k in kohya if k.startswith("lora_unet_")
                    and k.endswith(".lora_down.weight")}
    for module in unet_modules:
        original = module.removeprefix("lora_unet_")
        target = next(key for key in applied if key.replace(".", "_") == original + "_weight")
        scale = kohya[f"{module}.alpha"].item() / kohya[f"{module}.lora_down.weight"].shape[0]
        applied[target] = applied[target] + scale * kohya[f"{module}.lora_up.weight"] @ kohya[f"{module}.lora_down.weight"]
    expected = layout.to_original(merged, entries)
    assert applied.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(applied[key], expected[key], rtol=0, atol=2e-6, msg=key)
    # Fused modules: one pair per original module, q/k/v together.
    fused = "lora_unet_double_blocks_0_img_attn_qkv" if name == "flux" else "lora_unet_joint_blocks_0_x_block_attn_qkv"
    assert kohya[f"{fused}.lora_down.weight"].shape[0] == 3 * RANK
    assert kohya[f"{fused}.alpha"].item() == ALPHA * 3
    # Text encoders keep their own modules, kohya-named as sd-scripts names them for these families.
    assert any(k.startswith("lora_te1_text_model_encoder_layers_0_self_attn_q_proj") for k in kohya)
    assert any(k.startswith("lora_te2_") for k in kohya) == (name == "sd3")

    # Read back: the same adapters, part by part.
    text_free = {k: v for k, v in kohya.items() if k.startswith("lora_unet_")}
    peft, scales = layout.lora_from_original(text_free, entries, shapes)
    trained = lora_modules(bundle)["transformer"]
    assert peft.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(peft[key], value), key
    assert set(scales.values()) == {ALPHA / RANK}


def test_diffusers_reads_the_flux_kohya_layout(tandem_home, tmp_path):
    """diffusers' reader of sd-scripts' Flux files (`_convert_kohya_flux_lora_to_diffusers`) splits the fused
    q/k/v adapters back and gives the trained model's output."""
    bundle = trained_lora("flux", FLUX_DOUBLE_BLOCK_TARGETS, text_encoder=True)
    path = save_lora(bundle, tmp_path / "lora.safetensors", "kohya", "fp32")
    _, expected = prediction(bundle, bundle.denoiser)
    pipeline = _pipeline("flux")
    pipeline.load_lora_weights(str(path))
    text, out = prediction(bundle, pipeline.transformer, pipeline_text("flux", pipeline))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    expected_text, _ = prediction(bundle, bundle.denoiser)
    torch.testing.assert_close(text, expected_text, rtol=0, atol=1e-5)


def test_metadata_names_the_family(tandem_home, tmp_path):
    from safetensors import safe_open

    bundle = trained_lora("flux", ["to_q"], text_encoder=False)
    with safe_open(str(save_lora(bundle, tmp_path / "x.safetensors", "kohya", "fp16")), "pt") as f:
        metadata = f.metadata()
    assert metadata["tandem_model_type"] == "flux" and metadata["ss_base_model_version"] == "flux1"
    assert metadata["ss_network_dim"] == str(RANK)
