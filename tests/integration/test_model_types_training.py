"""End to end, per model type: a tiny SD1 / SD2 (v-prediction) / SDXL model, written as a diffusers
folder and as an original-layout single file, trains 2 steps with the real trainer from each source;
every output it writes then loads back where other tools load it:

- full fine-tune (`full_format=both`): the diffusers folder and the single file, through `load_model`,
  hold exactly the trainer's final UNet weights, and keep the model type and prediction type;
- LoRA (`lora_format=both`, UNet and text encoders): the peft file through diffusers' own
  `load_lora_weights` gives the same text embeddings and UNet output as the trainer's LoRA-carrying
  model; the kohya file names every adapted module, with the trainer's weights.

The tiny models use the structure of the real ones (tests/unit/test_single_file.py: SD2's OpenCLIP-style
encoder and linear projections, SDXL's two encoders and size/crop "time ids"), so each family takes its
own path through loading, conditioning and saving. The full fine-tune runs from both sources, LoRA from the
folder (the LoRA outputs depend on the modules, which both sources give alike): 9 runs of 2 steps, on the demo's
first 4 images (`demo_data_subset`: each run caches its data anew, and the whole demo dataset's cache would cost
more than the steps).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import types
from pathlib import Path

import pytest
import torch
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from safetensors import safe_open
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from modules.config.train_config import ModelConfig
from modules.model.kohya_lora import kohya_module_name
from modules.model.loading import load_model
from modules.model.single_file import save_single_file, shipped_config
from modules.model.tokenizer import EOS_TOKEN, OPEN_CLIP_PAD_TOKEN, clip_tokenizer
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from tests.unit.test_single_file import tiny_configs
from tests.trainer_helpers import demo_config, demo_data_subset

MODEL_TYPES = ("sd1", "sd2", "sdxl")
SOURCES = ("folder", "single_file")
PREDICTION_TYPES = {"sd1": "epsilon", "sd2": "v_prediction", "sdxl": "epsilon"}
KOHYA_TEXT_PREFIXES = {"sd1": ["lora_te"], "sd2": ["lora_te"], "sdxl": ["lora_te1", "lora_te2"]}
PIPELINES = {"sd1": StableDiffusionPipeline, "sd2": StableDiffusionPipeline, "sdxl": StableDiffusionXLPipeline}
CAPTIONS = ["a red circle on a blue background", "a white triangle"]
LORA_RANK, LORA_ALPHA = 4, 8.0


# The tiny models are far slower with several threads on a busy 2-core machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------ the tiny source models


def tiny_pipeline(model_type: str):
    """A tiny `model_type` pipeline built by diffusers' own classes, default-initialised with a fixed seed
    (small activations, so 2 training steps stay finite and meaningful)."""
    configs = tiny_configs(model_type)
    torch.manual_seed(7)
    unet = UNet2DConditionModel(**configs["unet"])
    vae = AutoencoderKL(**configs["vae"])
    text_encoder = CLIPTextModel(CLIPTextConfig(**configs["text_encoder"]))
    # OpenCLIP (SD2, SDXL's second encoder) pads with "!", OpenAI CLIP with the end token.
    tokenizer = clip_tokenizer(OPEN_CLIP_PAD_TOKEN if model_type == "sd2" else EOS_TOKEN)
    scheduler = DDPMScheduler.from_config(
        {**shipped_config(model_type, "scheduler"), "prediction_type": PREDICTION_TYPES[model_type]})
    if model_type == "sdxl":
        text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**configs["text_encoder_2"]))
        return StableDiffusionXLPipeline(
            vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
            tokenizer_2=clip_tokenizer(OPEN_CLIP_PAD_TOKEN), unet=unet, scheduler=scheduler)
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def write_sources(model_type: str, root: Path) -> dict[str, Path]:
    """The same tiny model as a diffusers folder (written by diffusers) and as a Tandem single file."""
    pipeline = tiny_pipeline(model_type)
    folder = root / f"tiny-{model_type}"
    pipeline.save_pretrained(folder, safe_serialization=True)
    encoders = [pipeline.text_encoder] + ([pipeline.text_encoder_2] if model_type == "sdxl" else [])
    # save_single_file reads only these attributes; it records the tiny configs in the file's metadata,
    # so the file loads back without config_overrides.
    parts = types.SimpleNamespace(model_type=model_type, unet=pipeline.unet, vae=pipeline.vae,
                                  text_encoders=encoders, prediction_type=PREDICTION_TYPES[model_type])
    single_file = save_single_file(parts, root / f"tiny-{model_type}.safetensors", torch.float32)
    return {"folder": folder, "single_file": single_file}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_sources")
    return {model_type: write_sources(model_type, root) for model_type in MODEL_TYPES}


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def train(model_type: str, base_model: Path, workspace: Path, cache: Path, method: str) -> tuple[GenericTrainer, Path]:
    """2 steps of `method` on the demo shapes (UNet and text encoders); the finished trainer and its output path."""
    cfg = demo_config(
        workspace, cache, *demo_data_subset(cache.with_name(cache.name + "-data"), "#demo", 4),
        f"model.base_model={base_model}", "training.max_steps=2", "training.batch_size=2",
        "training.precision=fp32", "data.resolution=64", f"training.lora_rank={LORA_RANK}",
        f"training.lora_alpha={LORA_ALPHA}", "training.train_text_encoder=true", "training.learning_rate=0.01",
        "save.lora_format=both", "save.full_format=both", "save.output_name=tiny", method=method)
    callbacks = RecordingCallbacks()
    trainer = GenericTrainer(cfg, callbacks)
    trainer.run()
    done = callbacks.of_type("done")[-1]
    assert done["completed"] and done["step"] == 2, done
    losses = [event["loss"] for event in callbacks.of_type("loss")]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
    # What was trained is what the source holds, with the family's own prediction type.
    assert trainer.bundle.model_type == model_type
    assert trainer.bundle.prediction_type == PREDICTION_TYPES[model_type]
    assert trainer.bundle.noise_scheduler.config.prediction_type == PREDICTION_TYPES[model_type]
    return trainer, Path(done["output"])


def _trained_away_from(trainer: GenericTrainer, source: Path) -> None:
    """Two steps at a high learning rate moved the UNet and text encoders: the comparisons are not vacuous."""
    base = load_model(ModelConfig(base_model=str(source))).modules()
    for name, module in trainer.bundle.modules().items():
        if name != "vae":
            before, after = base[name].state_dict(), module.state_dict()
            assert any(not torch.equal(before[k], after[k]) for k in before), f"training did not change the {name}"


# ------------------------------------------------------------------ full fine-tune


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_full_finetune_outputs_load_back_exactly(tmp_path, sources, cache_dir, model_type, source):
    trainer, folder = train(model_type, sources[model_type][source], tmp_path / "ws", cache_dir, "full")
    _trained_away_from(trainer, sources[model_type][source])
    single_file = folder.with_name(folder.name + ".safetensors")
    assert (folder / "model_index.json").is_file() and single_file.is_file()
    trained = trainer.bundle.modules()
    for output in (folder, single_file):
        loaded = load_model(ModelConfig(base_model=str(output)))
        assert (loaded.model_type, loaded.prediction_type) == (model_type, PREDICTION_TYPES[model_type]), output
        # The trained UNet and text encoders, exactly (fp32 training, fp32 save).
        for name, module in loaded.modules().items():
            if name != "vae":
                _assert_same_weights(module.state_dict(), trained[name].state_dict(), f"{output} {name}")


def _assert_same_weights(actual: dict, expected: dict, where: str) -> None:
    assert actual.keys() == expected.keys(), where
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype == torch.float32 or not value.is_floating_point(), f"{where}: {key}"
        assert torch.equal(actual[key], value), f"{where}: {key}"


# ------------------------------------------------------------------ LoRA


def _lora_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: child for name, child in module.named_modules() if hasattr(child, "lora_A") and child.lora_A}


def _under_text_model(name: str) -> str:
    return name if name.startswith("text_model.") else "text_model." + name


def _time_ids() -> torch.Tensor:
    # SDXL's size/crop conditioning: original (64, 64), crop (0, 0), target (64, 64) per sample.
    return torch.tensor([[64, 64, 0, 0, 64, 64]] * len(CAPTIONS), dtype=torch.float32)


def _unet_inputs():
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(len(CAPTIONS), 4, 8, 8, generator=generator)
    return latents, torch.tensor([10, 700])


def _trainer_prediction(trainer: GenericTrainer) -> tuple[torch.Tensor, torch.Tensor]:
    """Text embeddings and UNet output of the trainer's LoRA-carrying model, as it trained."""
    bundle = trainer.bundle
    for module in bundle.modules().values():
        module.eval()
    latents, timesteps = _unet_inputs()
    with torch.no_grad():
        text = bundle.encode_text(CAPTIONS)
        sizes, crops = [(64, 64)] * len(CAPTIONS), [(0, 0)] * len(CAPTIONS)
        added = bundle.added_cond(text, sizes, crops, sizes)
        if added is not None:
            assert torch.equal(added["time_ids"], _time_ids())
        out = bundle.unet(latents, timesteps, text["encoder_hidden_states"], added_cond_kwargs=added).sample
    return text["encoder_hidden_states"], out


def _diffusers_prediction(model_type: str, pipeline) -> tuple[torch.Tensor, torch.Tensor]:
    """The same through diffusers alone (`encode_prompt`, the pipeline's UNet)."""
    latents, timesteps = _unet_inputs()
    with torch.no_grad():
        encoded = pipeline.encode_prompt(CAPTIONS, device="cpu", num_images_per_prompt=1,
                                         do_classifier_free_guidance=False)
        hidden, added = encoded[0], None
        if model_type == "sdxl":
            added = {"text_embeds": encoded[2], "time_ids": _time_ids()}
        out = pipeline.unet(latents, timesteps, hidden, added_cond_kwargs=added).sample
    return hidden, out


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lora_outputs_load_in_diffusers_and_kohya_names_every_module(tmp_path, sources, cache_dir, model_type):
    """From the diffusers folder only: the single file loads as the same model (the same weights and configs:
    tests/unit/test_single_file.py's test_save_then_load_gives_identical_models, per type), training from it is
    test_full_finetune_outputs_load_back_exactly's (`train` checks the model and prediction type each source
    gives), so its LoRA outputs would be these."""
    trainer, kohya_file = train(model_type, sources[model_type]["folder"], tmp_path / "ws", cache_dir, "lora")
    bundle = trainer.bundle
    peft_file = kohya_file.with_name(kohya_file.name.replace(".safetensors", ".peft.safetensors"))
    assert kohya_file.is_file() and peft_file.is_file()

    # peft file -> diffusers (pipeline from the base folder, `load_lora_weights`): same text embeddings and UNet
    # output as the trainer's model.
    expected_hidden, expected_out = _trainer_prediction(trainer)
    pipeline = PIPELINES[model_type].from_pretrained(sources[model_type]["folder"], local_files_only=True)
    base_hidden, base_out = _diffusers_prediction(model_type, pipeline)
    pipeline.load_lora_weights(str(peft_file))
    hidden, out = _diffusers_prediction(model_type, pipeline)
    torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-5)
    # ... and the LoRA is not a no-op: the base model's output differs.
    assert not torch.allclose(base_out, expected_out, atol=1e-4)
    assert not torch.allclose(base_hidden, expected_hidden, atol=1e-4)

    # kohya file: one lora_down/lora_up/alpha per adapted module, holding the trainer's weights.
    with safe_open(str(kohya_file), "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}
        metadata = file.metadata()
    # SDXL UNet modules by their original-layout names (as sd-scripts writes them), SD1/SD2 by diffusers'.
    adapted = {kohya_module_name(model_type, "unet", name, bundle.unet.config): module
               for name, module in _lora_modules(bundle.unet).items()}
    if model_type == "sdxl":
        assert all("input_blocks" in n or "middle_block" in n or "output_blocks" in n for n in adapted)
    for prefix, encoder in zip(KOHYA_TEXT_PREFIXES[model_type], bundle.text_encoders, strict=True):
        modules = _lora_modules(encoder)
        assert modules, f"{prefix}: the text encoder has no LoRA"
        # Kohya spells text-encoder modules as checkpoints do, under `text_model.` (which transformers 5
        # keeps on CLIPTextModelWithProjection but dropped from CLIPTextModel).
        adapted.update({f"{prefix}_{_under_text_model(name).replace('.', '_')}": m for name, m in modules.items()})
    downs = [key for key in tensors if key.endswith(".lora_down.weight")]
    assert len(downs) == len(adapted) == len(tensors) // 3
    assert {key.removesuffix(".lora_down.weight") for key in downs} == set(adapted)
    for name, module in adapted.items():
        torch.testing.assert_close(tensors[f"{name}.lora_down.weight"], module.lora_A["default"].weight, rtol=0, atol=0)
        torch.testing.assert_close(tensors[f"{name}.lora_up.weight"], module.lora_B["default"].weight, rtol=0, atol=0)
        assert tensors[f"{name}.alpha"].item() == LORA_ALPHA
    assert metadata["ss_network_dim"] == str(LORA_RANK)
    assert metadata["ss_v_parameterization"] == str(PREDICTION_TYPES[model_type] == "v_prediction")
    assert metadata["tandem_model_type"] == model_type

