"""Save a fully trained model: a diffusers folder, or one single-file checkpoint.

Weights are converted to the save dtype one tensor at a time, so the model being trained is never
touched (no lossy in-place dtype round trip) and no full second copy in the training dtype is made.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .bundle import ModelBundle, checkpoint_text_encoder_key
from modules.util.atomic import atomic_directory

from .files import resolve_save_dtype

_PIPELINE_CLASS = {
    "sd1": "StableDiffusionPipeline", "sd2": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline",
}


def save_full_diffusers(
    bundle: ModelBundle,
    folder: str | Path,
    dtype: str | torch.dtype = "fp16",
    unet_state_override: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a complete diffusers model folder that `from_pretrained` (and Tandem) can load.

    `unet_state_override` replaces the UNet weights (e.g. the EMA copy). The folder is written
    beside its final place and renamed in, so an existing output is replaced whole or not at all.
    """
    import diffusers

    torch_dtype = resolve_save_dtype(dtype)
    folder = Path(folder)
    _refuse_adapters(bundle)
    unet_state = unet_state_override if unet_state_override is not None else bundle.unet.state_dict()
    _check_same_keys(bundle.unet.state_dict(), unet_state)

    with atomic_directory(folder, replace=True) as temp:
        _save_diffusers_model(bundle.unet, unet_state, temp / "unet", torch_dtype)
        _save_diffusers_model(bundle.vae, bundle.vae.state_dict(), temp / "vae", torch_dtype)
        components = {"unet": bundle.unet, "vae": bundle.vae}
        for index, (encoder, tokenizer) in enumerate(zip(bundle.text_encoders, bundle.tokenizers)):
            suffix = "" if index == 0 else f"_{index + 1}"
            _save_text_encoder(encoder, temp / f"text_encoder{suffix}", torch_dtype)
            tokenizer.save_pretrained(temp / f"tokenizer{suffix}")
            components[f"text_encoder{suffix}"] = encoder
            components[f"tokenizer{suffix}"] = tokenizer
        scheduler = bundle.extra.get("scheduler", bundle.noise_scheduler)
        scheduler.save_pretrained(temp / "scheduler")
        components["scheduler"] = scheduler
        index = _model_index(bundle.model_type, components, diffusers.__version__)
        (temp / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


def save_full_single_file(
    bundle: ModelBundle,
    path: str | Path,
    dtype: str | torch.dtype = "fp16",
    unet_state_override: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write one original-layout `.safetensors` checkpoint (A1111/ComfyUI/Forge) via `single_file`."""
    from .single_file import save_single_file

    _refuse_adapters(bundle)
    if unet_state_override is not None:
        _check_same_keys(bundle.unet.state_dict(), unet_state_override)
    save_single_file(bundle, Path(path), resolve_save_dtype(dtype), unet_state_override=unet_state_override)
    return Path(path)


def _refuse_adapters(bundle: ModelBundle) -> None:
    for name, module in bundle.modules().items():
        if getattr(module, "peft_config", None):
            raise ValueError(
                f"the {name} carries LoRA adapters; a full-model save would store the adapter layout. "
                "Save the LoRA with save_lora, or train with training.method = full"
            )


def _check_same_keys(expected: dict, given: dict) -> None:
    missing, unexpected = set(expected) - set(given), set(given) - set(expected)
    if missing or unexpected:
        raise ValueError(
            f"unet_state_override does not match the UNet: {len(missing)} missing keys "
            f"(e.g. {sorted(missing)[:3]}), {len(unexpected)} unexpected (e.g. {sorted(unexpected)[:3]})"
        )


def _converted(state: dict[str, torch.Tensor], dtype: torch.dtype, rename=lambda key: key) -> dict[str, torch.Tensor]:
    # Floating tensors take the save dtype; integer buffers (e.g. CLIP position ids) keep theirs.
    return {
        rename(key): (value.detach().to("cpu", dtype if value.is_floating_point() else value.dtype)).contiguous()
        for key, value in state.items()
    }


def _save_diffusers_model(model, state: dict, folder: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    model.save_config(folder)
    save_file(_converted(state, dtype), folder / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})


def _save_text_encoder(encoder, folder: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = encoder.config.to_dict()
    config["architectures"] = [type(encoder).__name__]
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    # Checkpoint key names (with `text_model.`) load in transformers 4 and 5 alike.
    state = _converted(encoder.state_dict(), dtype, checkpoint_text_encoder_key)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _model_index(model_type: str, components: dict, diffusers_version: str) -> dict:
    index = {"_class_name": _PIPELINE_CLASS[model_type], "_diffusers_version": diffusers_version}
    for name, component in components.items():
        library = "diffusers" if type(component).__module__.startswith("diffusers") else "transformers"
        index[name] = [library, type(component).__name__]
    for unused in ("feature_extractor", "image_encoder") + (("safety_checker",) if model_type != "sdxl" else ()):
        index[unused] = [None, None]
    if model_type == "sdxl":
        index["force_zeros_for_empty_prompt"] = True
    else:
        index["requires_safety_checker"] = False
    return index
