"""Save a fully trained model: a diffusers folder, or one single-file checkpoint in the family's layout.

Weights are converted to the save dtype one tensor at a time, so the model being trained is never
touched (no lossy in-place dtype round trip) and no full second copy in the training dtype is made.
The folder layout is the same for every family (one subfolder per component, as the family's
pipeline saves it); the single-file layout is the family's (`family.save_single_file`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from modules.util.atomic import atomic_directory

from .bundle import ModelBundle, checkpoint_text_encoder_key, text_encoder_name
from .files import resolve_save_dtype


def save_full_diffusers(
    bundle: ModelBundle,
    folder: str | Path,
    dtype: str | torch.dtype = "fp16",
    unet_state_override: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a complete diffusers model folder that `from_pretrained` (and Tandem) can load.

    `unet_state_override` replaces the denoiser's weights (UNet or transformer; e.g. the EMA copy). The folder is written
    beside its final place and renamed in, so an existing output is replaced whole or not at all.
    """
    import diffusers

    torch_dtype = resolve_save_dtype(dtype)
    folder = Path(folder)
    _refuse_adapters(bundle)
    denoiser = bundle.denoiser
    unet_state = unet_state_override if unet_state_override is not None else denoiser.state_dict()
    _check_same_keys(denoiser.state_dict(), unet_state)

    with atomic_directory(folder, replace=True) as temp:
        _save_diffusers_model(denoiser, unet_state, temp / bundle.denoiser_name, torch_dtype)
        _save_diffusers_model(bundle.vae, bundle.vae.state_dict(), temp / "vae", torch_dtype)
        components = {bundle.denoiser_name: denoiser, "vae": bundle.vae}
        for index, (encoder, tokenizer) in enumerate(zip(bundle.text_encoders, bundle.tokenizers)):
            name = text_encoder_name(index)
            _save_text_encoder(encoder, temp / name, torch_dtype)
            tokenizer.save_pretrained(temp / name.replace("text_encoder", "tokenizer"))
            components[name] = encoder
            components[name.replace("text_encoder", "tokenizer")] = tokenizer
        scheduler = bundle.extra.get("scheduler", bundle.noise_scheduler)
        scheduler.save_pretrained(temp / "scheduler")
        components["scheduler"] = scheduler
        index = _model_index(bundle.family, components, diffusers.__version__)
        (temp / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


def save_full_single_file(
    bundle: ModelBundle,
    path: str | Path,
    dtype: str | torch.dtype = "fp16",
    unet_state_override: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write one `.safetensors` checkpoint in the layout of the family's original files (SD: LDM, as
    A1111/ComfyUI/Forge read it; SD3.5: Stability's; Flux: Black Forest Labs')."""
    _refuse_adapters(bundle)
    if unet_state_override is not None:
        _check_same_keys(bundle.denoiser.state_dict(), unet_state_override)
    bundle.family.save_single_file(bundle, Path(path), resolve_save_dtype(dtype), unet_state_override)
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
            f"unet_state_override does not match the denoiser: {len(missing)} missing keys "
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
    # CLIP: checkpoint key names (with `text_model.`) load in transformers 4 and 5 alike.
    is_clip = type(encoder).__name__.startswith("CLIP")
    state = _converted(_untied(encoder), dtype, checkpoint_text_encoder_key if is_clip else (lambda key: key))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _untied(model) -> dict[str, torch.Tensor]:
    """The state dict without the copies of tied weights (T5's `encoder.embed_tokens` is `shared`):
    safetensors refuses two names for one tensor, and transformers ties them again when loading."""
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    return {key: value for key, value in model.state_dict().items() if key not in tied}


def _model_index(family, components: dict, diffusers_version: str) -> dict:
    index = {"_class_name": family.info.pipeline_class, "_diffusers_version": diffusers_version}
    for name, component in components.items():
        library = "diffusers" if type(component).__module__.startswith("diffusers") else "transformers"
        index[name] = [library, type(component).__name__]
    index.update(family.model_index_extras())  # unused components, pipeline flags
    return index
