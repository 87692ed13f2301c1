"""Flux.2 (dev and Klein) and Chroma LoRA files: the peft file through each pipeline's `load_lora_weights`,
the kohya file by ComfyUI's key rules and merge (and through diffusers' kohya readers), the presets' target
modules, and the metadata naming family and variant."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modules.families.registry import FAMILIES
from modules.config.train_config import ModelConfig, TrainingConfig
from modules.model import add_lora, load_model, save_lora
from modules.model.families import family
from modules.model.families import original_layout as layout
from modules.model.families.dit_demo import ensure_dit_demo
from modules.model.lora import lora_modules
from modules.util.batch_slice import BatchSlice
from tests.unit.test_flux2_chroma import CAPTIONS, CPU, DEMOS, EACH_FAMILY_QUICK, _same, family_of, pipeline_class

RANK, ALPHA = 4, 8.0

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def demos(tandem_home) -> dict:
    return {name: load_model(ModelConfig(base_model=str(ensure_dit_demo(name)), t5_max_length=24)) for name in DEMOS}


def trained_lora(demos, name: str, targets=None):
    """A fresh copy of the demo with LoRA (rank 4, alpha 8) on the family's preset targets, moved off zero."""
    bundle = load_model(ModelConfig(base_model=str(ensure_dit_demo(name)), t5_max_length=24))
    targets = list(targets or FAMILIES[family_of(name)].lora_targets)
    params = add_lora(bundle, TrainingConfig(lora_rank=RANK, lora_alpha=ALPHA, lora_target_modules=targets))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in params:
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    for module in bundle.modules().values():
        module.eval()
    return bundle


def prediction(bundle, transformer) -> torch.Tensor:
    """The transformer's output for fixed inputs, text encoded by Tandem (these text encoders never train)."""
    name = bundle.model_type
    objective = bundle.family.objective(bundle, TrainingConfig(flux_guidance=2.0))
    latents = torch.randn(2, 16 if name == "chroma" else 32, 8, 8, generator=torch.Generator().manual_seed(3))
    draw = objective.draw(tuple(latents.shape), 5, 0, 0, BatchSlice(0, 2, 2), CPU)
    with torch.no_grad():
        return objective.predict(transformer, objective.noisy(latents, draw), draw.timesteps, bundle.encode_text(CAPTIONS))


def test_family_targets_adapt_the_fused_projections(demos):
    """Flux.2's preset targets adapt the single blocks' fused q/k/v + MLP input and their fused output (not
    the double blocks' `attn.to_out` container); Chroma's cover every part of its single blocks' `linear1`."""
    flux2 = {n for n, m in trained_lora(demos, "flux2").denoiser.named_modules() if hasattr(m, "lora_A")}
    assert {"single_transformer_blocks.1.attn.to_qkv_mlp_proj", "single_transformer_blocks.1.attn.to_out",
            "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.add_q_proj"} <= flux2
    assert "transformer_blocks.0.attn.to_out" not in flux2
    chroma = {n for n, m in trained_lora(demos, "chroma").denoiser.named_modules() if hasattr(m, "lora_A")}
    entries = family("chroma").layout(demos["chroma"].denoiser.config, demos["chroma"].denoiser.state_dict())
    linear1 = next(e for e in entries if e.original == "single_blocks.0.linear1")
    assert set(linear1.parts) <= chroma


@pytest.mark.parametrize("name", EACH_FAMILY_QUICK)
def test_peft_file_loads_in_diffusers_with_the_same_output(demos, tmp_path, name):
    bundle = trained_lora(demos, name)
    path = save_lora(bundle, tmp_path / "lora.safetensors", "peft", "fp32")
    expected = prediction(bundle, bundle.denoiser)
    pipeline = pipeline_class(name).from_pretrained(ensure_dit_demo(name), local_files_only=True)
    base = prediction(bundle, pipeline.transformer)
    pipeline.load_lora_weights(str(path))
    torch.testing.assert_close(prediction(bundle, pipeline.transformer), expected, rtol=0, atol=1e-5)
    assert not torch.allclose(base, expected, atol=1e-4), "the LoRA changed nothing: the comparison is vacuous"


def comfy_lora_keys(original_state: dict) -> dict[str, tuple[int, ...]]:
    """The kohya LoRA names ComfyUI's `model_lora_keys_unet` accepts for a model whose weights carry these
    original-layout names (its Flux, Flux.2 and Chroma models hold them under `diffusion_model.`):
    `lora_unet_` + the weight's path with `_` for `.`, mapped to the weight's shape (an adapter of another
    shape is refused there: "SHAPE MISMATCH")."""
    return {"lora_unet_" + key.removesuffix(".weight").replace(".", "_"): tuple(value.shape)
            for key, value in original_state.items() if key.endswith(".weight")}


@pytest.mark.parametrize("name", EACH_FAMILY_QUICK)
def test_kohya_file_follows_comfyuis_rules_and_is_the_trained_model(demos, tmp_path, name):
    """Every module of the kohya file is a name ComfyUI maps to a weight of the same shape, and applying the
    file as ComfyUI does (W += alpha / rank * up @ down) gives the LoRA-merged model's weights exactly."""
    bundle = trained_lora(demos, name)
    kohya = load_file(str(save_lora(bundle, tmp_path / "lora.safetensors", "kohya", "fp32")))
    transformer = bundle.denoiser
    base = {k.replace(".base_layer", ""): v for k, v in transformer.state_dict().items() if ".lora_" not in k}
    merged = dict(base)
    for path, module in transformer.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            delta = module.lora_B["default"].weight @ module.lora_A["default"].weight
            merged[f"{path}.weight"] = merged[f"{path}.weight"] + ALPHA / RANK * delta
    entries = bundle.family.layout(transformer.config, {k: v.shape for k, v in base.items()})
    applied, expected = layout.to_original(base, entries), layout.to_original(merged, entries)
    accepted = comfy_lora_keys(applied)
    modules = {k.removesuffix(".lora_down.weight") for k in kohya if k.endswith(".lora_down.weight")}
    assert modules and modules <= set(accepted), sorted(modules - set(accepted))[:3]
    assert {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in kohya} == modules
    for module in modules:
        up, down = kohya[f"{module}.lora_up.weight"], kohya[f"{module}.lora_down.weight"]
        assert (up.shape[0], down.shape[1]) == accepted[module]
        key = module.removeprefix("lora_unet_")
        target = next(k for k in applied if k.removesuffix(".weight").replace(".", "_") == key)
        applied[target] = applied[target] + kohya[f"{module}.alpha"].item() / down.shape[0] * up @ down
    for key in expected:
        torch.testing.assert_close(applied[key], expected[key], rtol=0, atol=2e-6, msg=key)
    fused = "lora_unet_single_blocks_0_linear1"
    assert f"{fused}.lora_down.weight" in kohya
    peft, _ = layout.lora_from_original(kohya, entries, {k: v.shape for k, v in base.items()})
    _same(peft, lora_modules(bundle)["transformer"], "read back")


def comfy_diffusers_lora_modules(double: int, single: int) -> set[str]:
    """The diffusers module names ComfyUI maps for LoRAs of its Flux-type models (Flux.1, Flux.2 and Chroma are
    all `model_base.Flux` there): `transformer.` + a module of `comfy.utils.flux_to_diffusers`, transcribed."""
    blocks = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
              "attn.to_out.0", "norm1.linear", "norm1_context.linear", "attn.to_add_out", "ff.net.0.proj",
              "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "ff.linear_in", "ff.linear_out",
              "ff_context.linear_in", "ff_context.linear_out", "attn.norm_q", "attn.norm_k", "attn.norm_added_q",
              "attn.norm_added_k"]
    singles = ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "norm.linear", "proj_out", "attn.norm_q",
               "attn.norm_k", "attn.to_qkv_mlp_proj", "attn.to_out"]
    basic = ["proj_out", "x_embedder", "time_text_embed.timestep_embedder.linear_1",
             "time_text_embed.timestep_embedder.linear_2", "context_embedder", "time_text_embed.text_embedder.linear_1",
             "time_text_embed.text_embedder.linear_2", "time_text_embed.guidance_embedder.linear_1",
             "time_text_embed.guidance_embedder.linear_2", "norm_out.linear", "controlnet_x_embedder"]
    return ({f"transformer_blocks.{i}.{m}" for i in range(double) for m in blocks}
            | {f"single_transformer_blocks.{i}.{m}" for i in range(single) for m in singles} | set(basic))


@pytest.mark.parametrize("name", EACH_FAMILY_QUICK)
def test_comfyui_maps_every_module_of_the_peft_file(demos, tmp_path, name):
    """ComfyUI reads the peft file too (`transformer.<module>` names) when every adapted module of the
    family's preset targets is one it maps."""
    bundle = trained_lora(demos, name)
    peft = load_file(str(save_lora(bundle, tmp_path / "lora.safetensors", "peft", "fp32")))
    modules = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in peft}
    config = bundle.denoiser.config
    assert modules <= comfy_diffusers_lora_modules(config["num_layers"], config["num_single_layers"]), \
        sorted(modules - comfy_diffusers_lora_modules(config["num_layers"], config["num_single_layers"]))[:3]


@pytest.mark.parametrize("name", ["flux2", pytest.param("flux2-klein", marks=pytest.mark.slow)])
def test_diffusers_reads_the_flux2_kohya_layout(demos, tmp_path, name):
    """diffusers' reader of kohya Flux.2 files gives the trained model's output from Tandem's kohya file."""
    bundle = trained_lora(demos, name)
    path = save_lora(bundle, tmp_path / "lora.safetensors", "kohya", "fp32")
    pipeline = pipeline_class(name).from_pretrained(ensure_dit_demo(name), local_files_only=True)
    pipeline.load_lora_weights(str(path))
    torch.testing.assert_close(prediction(bundle, pipeline.transformer), prediction(bundle, bundle.denoiser),
                               rtol=0, atol=1e-5)


def test_diffusers_reads_the_chroma_kohya_layout(demos, tmp_path):
    """diffusers reads Chroma's kohya file through its Flux reader (which assumes the real width in the single
    blocks' fused projection, so here with double-block adapters only)."""
    targets = [f"transformer_blocks.{i}.attn.{m}" for i in range(2) for m in ("to_q", "to_k", "to_v", "to_out.0",
                                                                               "add_q_proj", "add_v_proj", "to_add_out")]
    bundle = trained_lora(demos, "chroma", targets)
    path = save_lora(bundle, tmp_path / "lora.safetensors", "kohya", "fp32")
    pipeline = pipeline_class("chroma").from_pretrained(ensure_dit_demo("chroma"), local_files_only=True)
    pipeline.load_lora_weights(str(path))
    torch.testing.assert_close(prediction(bundle, pipeline.transformer), prediction(bundle, bundle.denoiser),
                               rtol=0, atol=1e-5)


def test_lora_metadata_names_the_family_and_variant(demos, tmp_path):
    expected = {"chroma": ("chroma/lora", "https://huggingface.co/lodestones/Chroma", "chroma"),
                "flux2": ("flux-2-dev/lora", "https://github.com/black-forest-labs/flux2", "flux2"),
                "flux2-klein": ("flux-2-klein/lora", "https://github.com/black-forest-labs/flux2", "flux2")}
    for name, (architecture, implementation, version) in expected.items():
        bundle = trained_lora(demos, name, ["to_q"])
        with safe_open(str(save_lora(bundle, tmp_path / f"{name}.safetensors", "kohya", "fp16")), "pt") as f:
            metadata = f.metadata()
        assert metadata["modelspec.architecture"] == architecture, name
        assert metadata["modelspec.implementation"] == implementation and metadata["ss_base_model_version"] == version


