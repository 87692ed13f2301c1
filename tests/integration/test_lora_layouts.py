"""LoRA files other tools read: SDXL kohya names in the original layout, today's diffusers/peft layout,
reading every layout back (old Tandem files too), and the metadata (ModelSpec, kohya's ss_*)."""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from modules.config.train_config import ModelConfig, TrainingConfig
from modules.model import add_lora, load_model, save_lora
from modules.model.kohya_lora import kohya_module_name
from modules.model.ldm_layout import unet_module_to_ldm
from modules.model.lora import lora_modules
from modules.model.lora_convert import convert_lora_file
from modules.model.lora_reading import apply_lora, read_lora
from modules.model.single_file import shipped_config, unet_to_ldm
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from tests.trainer_helpers import tandem_log
from tests.integration.test_model_types_training import write_sources
from tests.unit.test_single_file import randomize, tiny_configs
from tests.trainer_helpers import demo_config, demo_data_subset

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Attention, feed-forward and projections (what diffusers loads from a kohya SDXL file), plus the
# resnet/sampler/embedding layers a full kohya network also adapts (checked by name only).
ATTENTION_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]
CAPTIONS = ["a red circle on a blue background", "a white triangle"]


def _layers(unet: torch.nn.Module) -> list[str]:
    return [name for name, m in unet.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]


# ------------------------------------------------------------------ the SDXL key map


def test_sdxl_kohya_names_are_the_single_file_unets_names_for_every_layer():
    """Each UNet layer's kohya name is its name in the single-file UNet: the weight stored under that
    original-layout key is the layer's weight, as diffusers' own single-file converter reads it back."""
    configs = tiny_configs("sdxl")
    unet = randomize(UNet2DConditionModel(**configs["unet"]), 5)
    state = unet.state_dict()
    ldm = unet_to_ldm(state, unet.config)
    # diffusers' converter (independent of Tandem's map) must give every tensor back under its own key.
    back = convert_ldm_unet_checkpoint(ldm, dict(unet.config))
    layers = _layers(unet)
    assert len(layers) > 50
    for path in layers:
        name = kohya_module_name("sdxl", "unet", path, unet.config)
        assert name.startswith("lora_unet_") and not any(
            part in name for part in ("down_blocks", "mid_block", "up_blocks")), name
        ldm_path = unet_module_to_ldm(path, unet.config)
        assert name == "lora_unet_" + ldm_path.replace(".", "_")
        key = f"model.diffusion_model.{ldm_path}.weight"
        assert key in ldm, key
        assert torch.equal(back[f"{path}.weight"], state[f"{path}.weight"])
        assert back[f"{path}.weight"] is ldm[key] or torch.equal(back[f"{path}.weight"], ldm[key])


def test_real_size_sdxl_kohya_names_match_sd_scripts():
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(shipped_config("sdxl", "unet"))
    names = {kohya_module_name("sdxl", "unet", path, unet.config) for path in _layers(unet)}
    for expected in (
        "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
        "lora_unet_input_blocks_8_1_transformer_blocks_9_ff_net_2",
        "lora_unet_input_blocks_7_1_proj_in",
        "lora_unet_middle_block_1_transformer_blocks_9_attn2_to_out_0",
        "lora_unet_output_blocks_5_1_proj_out",
        "lora_unet_output_blocks_0_1_transformer_blocks_0_ff_net_0_proj",
        "lora_unet_output_blocks_2_2_conv",  # an attention block's upsampler takes slot 2
        "lora_unet_input_blocks_3_0_op",
        "lora_unet_input_blocks_1_0_in_layers_2",
        "lora_unet_input_blocks_1_0_emb_layers_1",
        "lora_unet_output_blocks_0_0_skip_connection",
        "lora_unet_time_embed_0",
        "lora_unet_label_emb_0_0",
        "lora_unet_input_blocks_0_0",
        "lora_unet_out_2",
    ):
        assert expected in names, expected
    attention = [n for n in names if n.endswith(("_to_q", "_to_k", "_to_v", "_to_out_0"))]
    assert len(attention) == 70 * 8  # 70 transformer blocks, 2 attentions of 4 projections each
    # SD 1.x/2.x keep diffusers' names, as sd-scripts writes them.
    assert kohya_module_name("sd1", "unet", "down_blocks.0.attentions.0.proj_in") == \
        "lora_unet_down_blocks_0_attentions_0_proj_in"


# ------------------------------------------------------------------ diffusers loads both files


@pytest.fixture(scope="module")
def sdxl_source(tmp_path_factory):
    return write_sources("sdxl", tmp_path_factory.mktemp("tiny_sdxl"))["folder"]


def _time_ids():
    return torch.tensor([[64, 64, 0, 0, 64, 64]] * len(CAPTIONS), dtype=torch.float32)


def _inputs():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(len(CAPTIONS), 4, 8, 8, generator=generator), torch.tensor([10, 700])


def _tandem_prediction(bundle):
    latents, timesteps = _inputs()
    with torch.no_grad():
        text = bundle.encode_text(CAPTIONS)
        added = {"text_embeds": text["pooled"], "time_ids": _time_ids()}
        return text["encoder_hidden_states"], bundle.unet(latents, timesteps, text["encoder_hidden_states"],
                                                           added_cond_kwargs=added).sample


@pytest.fixture(scope="module")
def sdxl_pipeline(sdxl_source):
    """The tiny SDXL base as diffusers loads it, shared: `_diffusers_prediction` takes each LoRA off again."""
    return StableDiffusionXLPipeline.from_pretrained(sdxl_source, local_files_only=True)


def _diffusers_prediction(pipeline, lora_file):
    """The text embeddings and UNet output of the base pipeline with `lora_file` loaded by diffusers
    (`load_lora_weights`); the pipeline is the base again afterwards."""
    pipeline.load_lora_weights(str(lora_file))
    try:
        latents, timesteps = _inputs()
        with torch.no_grad():
            encoded = pipeline.encode_prompt(CAPTIONS, device="cpu", num_images_per_prompt=1,
                                             do_classifier_free_guidance=False)
            added = {"text_embeds": encoded[2], "time_ids": _time_ids()}
            return encoded[0], pipeline.unet(latents, timesteps, encoded[0], added_cond_kwargs=added).sample
    finally:
        pipeline.unload_lora_weights()


def _perturb(params, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in params:
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)


def _lora_bundle(source, targets=ATTENTION_TARGETS, seed=1):
    """`source` with LoRA on `targets`, its adapters' weights drawn from `seed`."""
    bundle = load_model(ModelConfig(base_model=str(source)))
    params = add_lora(bundle, TrainingConfig(lora_rank=4, lora_alpha=8.0, lora_target_modules=targets,
                                             train_text_encoder=True, precision="fp32"))
    _perturb(params, seed)
    for module in bundle.modules().values():
        module.eval()
    return bundle


@pytest.fixture(scope="module")
def sdxl_lora(sdxl_source):
    """The tiny SDXL with LoRA (seed 1), shared by the tests that only read or save it."""
    return _lora_bundle(sdxl_source)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["kohya", "peft", "old-kohya"])
def test_sdxl_lora_loads_in_diffusers_to_the_same_model(sdxl_lora, sdxl_pipeline, tmp_path, fmt):
    bundle = sdxl_lora
    expected_hidden, expected_out = _tandem_prediction(bundle)
    if fmt == "old-kohya":  # what earlier Tandem versions wrote still loads
        path = _old_tandem_files(bundle, tmp_path)[fmt]
        torch.testing.assert_close(_diffusers_prediction(sdxl_pipeline, path)[1], expected_out, rtol=0, atol=1e-5)
        return
    path = save_lora(bundle, tmp_path / f"sdxl-{fmt}.safetensors", fmt, "fp32")
    with safe_open(str(path), "pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
    if fmt == "kohya":
        unet_keys = [k for k in keys if k.startswith("lora_unet_")]
        assert unet_keys and all("input_blocks" in k or "middle_block" in k or "output_blocks" in k for k in unet_keys)
        assert {k.split("_", 2)[1] for k in keys if not k.startswith("lora_unet_")} == {"te1", "te2"}
        assert metadata["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
    else:
        assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
        assert {k.split(".")[0] for k in keys} == {"unet", "text_encoder", "text_encoder_2"}
        assert metadata["modelspec.implementation"] == "diffusers"
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert metadata["ss_base_model_version"] == "sdxl_base_v1-0"

    hidden, out = _diffusers_prediction(sdxl_pipeline, path)
    torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ reading every layout back


def _old_tandem_files(bundle, folder: Path) -> dict[str, Path]:
    """What Tandem wrote before: SDXL kohya UNet modules in diffusers' names, and the peft file through
    diffusers' `convert_state_dict_to_diffusers` (lora.down / lora_linear_layer.down spellings) with the
    adapter configs in its header, as today."""
    from diffusers.utils import convert_state_dict_to_diffusers

    with safe_open(str(save_lora(bundle, folder / "today.safetensors", "peft", "fp32")), "pt") as f:
        adapter_configs = f.metadata()["lora_adapter_metadata"]
    modules = lora_modules(bundle)
    prefixes = {"unet": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}
    if bundle.model_type != "sdxl":
        prefixes["text_encoder"] = "lora_te"
    kohya, peft = {}, {}
    for component, state in modules.items():
        for key, value in state.items():
            module_path, kind = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
            name = f"{prefixes[component]}_{module_path.replace('.', '_')}"
            kohya[f"{name}.{'lora_down' if kind == 'lora_A' else 'lora_up'}.weight"] = value.contiguous()
            kohya[f"{name}.alpha"] = torch.tensor(8.0)
        for key, value in convert_state_dict_to_diffusers(state).items():
            peft[f"{component}.{key}"] = value.contiguous()
    assert any(".lora.down." in k or ".lora_linear_layer.down." in k for k in peft)
    save_file(kohya, folder / "old-kohya.safetensors", {"tandem_base_model": "/home/someone/models/base"})
    save_file(peft, folder / "old-peft.safetensors", {"lora_adapter_metadata": adapter_configs})
    return {"old-kohya": folder / "old-kohya.safetensors", "old-peft": folder / "old-peft.safetensors"}


def _same_lora(a, b) -> None:
    left, right = lora_modules(a), lora_modules(b)
    assert left.keys() == right.keys()
    for component in left:
        assert left[component].keys() == right[component].keys()
        for key in left[component]:
            assert torch.equal(left[component][key], right[component][key]), (component, key)


def _adapter_weights(bundle) -> dict[str, torch.Tensor]:
    return {f"{part}.{name}": p for part, module in bundle.modules().items()
            for name, p in module.named_parameters() if "lora_" in name}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["sd1", "sdxl"])
def test_every_layout_tandem_writes_or_wrote_reads_back_exactly(sdxl_source, sdxl_lora, tandem_home, tmp_path,
                                                                model_type):
    """Each file read into a model with the same adapters but other weights (seed 9, set again before each file)
    gives the written adapters exactly."""
    source = sdxl_source if model_type == "sdxl" else "builtin:demo"
    original = sdxl_lora if model_type == "sdxl" else _lora_bundle(source)
    files = {fmt: save_lora(original, tmp_path / f"{fmt}.safetensors", fmt, "fp32") for fmt in ("kohya", "peft")}
    files.update(_old_tandem_files(original, tmp_path))
    fresh = _lora_bundle(source, seed=9)  # same adapters, other weights
    other_weights = {k: v.detach().clone() for k, v in _adapter_weights(fresh).items()}
    written = _adapter_weights(original)
    assert all(not torch.equal(v, written[k]) for k, v in other_weights.items()), "the comparison would be vacuous"
    for name, path in files.items():
        with torch.no_grad():
            for k, p in _adapter_weights(fresh).items():
                p.copy_(other_weights[k])
        weights = read_lora(path, fresh)
        assert (weights.layout, weights.rank["unet"], weights.alpha["unet"]) == (name.split("-")[-1], 4, 8.0), name
        apply_lora(fresh, weights)
        _same_lora(fresh, original)

@pytest.mark.slow

def test_an_old_sdxl_kohya_file_converts_to_the_original_names(sdxl_source, sdxl_lora, tmp_path):
    original = sdxl_lora
    old = _old_tandem_files(original, tmp_path)["old-kohya"]
    new = convert_lora_file(old, tmp_path / "new.safetensors", str(sdxl_source), "kohya", "fp32")
    with safe_open(str(new), "pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
    assert keys == set(safe_open(str(save_lora(original, tmp_path / "ref.safetensors", "kohya", "fp32")), "pt").keys())
    assert metadata["tandem_base_model"] == Path(sdxl_source).name  # the old file's full path is gone
    fresh = _lora_bundle(sdxl_source, seed=9)
    apply_lora(fresh, read_lora(new, fresh))
    _same_lora(fresh, original)

@pytest.mark.slow

def test_a_lora_for_another_model_is_refused_by_name(sdxl_lora, tandem_home, tmp_path):
    sdxl_file = save_lora(sdxl_lora, tmp_path / "x.safetensors", "kohya", "fp32")
    demo = _lora_bundle("builtin:demo")
    with pytest.raises(ValueError, match="is the LoRA for another base model"):
        read_lora(sdxl_file, demo)


# ------------------------------------------------------------------ metadata of a trained LoRA

@pytest.mark.slow

def test_trained_lora_metadata_has_modelspec_and_kohya_settings_and_no_local_path(tmp_path, tandem_home):
    workspace, cache = tmp_path / "ws", tmp_path / "cache"
    # 3 steps of 8 on the demo's first 24 images: one epoch, without caching the other 40.
    cfg = demo_config(workspace, cache, *demo_data_subset(tmp_path / "data", "#demo", 24),
                      "training.max_steps=3", "training.batch_size=4",
                      "training.gradient_accumulation_steps=2", "save.lora_format=both", "save.output_name=shapes",
                      "training.lora_rank=4", "training.lora_alpha=2", f"model.base_model={tandem_home}/demo-model")
    callbacks = RecordingCallbacks()
    before = datetime.datetime.now().replace(microsecond=0)
    trainer = GenericTrainer(cfg, callbacks)
    with tandem_log() as log_lines:
        trainer.run()
    # Each saved file's line says who applies it (modules/families/lora_clients.py), naming the run's other file.
    assert [line for line in log_lines if "layout, LoRA)" in line] == [
        "shapes.safetensors (kohya layout, LoRA): ComfyUI applies it exactly; diffusers applies it exactly",
        "shapes.peft.safetensors (peft layout, LoRA): ComfyUI skips its UNet attention layers (it knows them by the "
        "old `processor` names only) and applies the rest at alpha / rank = 1 instead of 0.5; for ComfyUI use "
        "shapes.safetensors; diffusers applies it exactly"]
    done = callbacks.of_type("done")[-1]
    kohya_file = Path(done["output"])
    peft_file = kohya_file.with_name(kohya_file.name.replace(".safetensors", ".peft.safetensors"))
    numbers = trainer.numbers
    for path in (kohya_file, peft_file):
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
        assert metadata["modelspec.sai_model_spec"] == "1.0.1"
        assert metadata["modelspec.architecture"] == "stable-diffusion-v1/lora"
        assert metadata["modelspec.implementation"] == "diffusers"
        assert metadata["modelspec.title"] == "shapes" and metadata["modelspec.resolution"] == "64x64"
        assert metadata["modelspec.prediction_type"] == "epsilon"
        assert datetime.datetime.fromisoformat(metadata["modelspec.date"]) >= before
        expected = {
            "ss_network_module": "networks.lora", "ss_network_dim": "4", "ss_network_alpha": "2.0",
            "ss_base_model_version": "sd_v1", "ss_v2": "False", "ss_output_name": "shapes",
            "ss_resolution": "(64, 64)", "ss_num_train_images": str(len(trainer.dataset)),
            "ss_num_epochs": str(numbers.epochs), "ss_steps": "3", "ss_max_train_steps": "3", "ss_epoch": "1",
            "ss_batch_size_per_device": "4", "ss_total_batch_size": "8", "ss_gradient_accumulation_steps": "2",
            "ss_learning_rate": str(numbers.lr), "ss_lr_scheduler": cfg.training.lr_scheduler,
            "ss_optimizer": "adamw", "ss_seed": str(cfg.general.seed), "ss_mixed_precision": cfg.training.precision,
            "ss_sd_model_name": "demo-model", "tandem_base_model": "demo-model", "tandem_step": "3",
        }
        assert {k: metadata.get(k) for k in expected} == expected
        assert float(metadata["ss_training_finished_at"]) >= float(metadata["ss_training_started_at"])
        dirs = json.loads(metadata["ss_dataset_dirs"])
        assert sum(d["img_count"] * d["n_repeats"] for d in dirs.values()) == len(trainer.dataset)
        # No absolute local path anywhere: not the base model's, the workspace's or the images'.
        for key, value in metadata.items():
            if key == "lora_adapter_metadata":
                continue
            assert str(tmp_path) not in value and str(tandem_home) not in value, (key, value)
            assert not value.startswith("/"), (key, value)
