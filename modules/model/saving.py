"""Save a fully trained model: a diffusers folder, or one single-file checkpoint in the family's layout.

Weights are converted to the save dtype and written one block at a time (`streamed_save.py`), so the
model being trained is never touched (no lossy in-place dtype round trip), no full second copy of it is
made, and a sharded run (FSDP) writes the same files without ever gathering the whole model.
The folder layout is the same for every family (one subfolder per component, as the family's
pipeline saves it); the single-file layout is the family's (`family.single_file_parts`).
"""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import torch

from modules.util.atomic import atomic_directory

from .bundle import ModelBundle, checkpoint_text_encoder_key, text_encoder_name
from .files import resolve_save_dtype
from .streamed_save import LOCAL, FilePart, TensorSource, stream_file

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"


def save_full_diffusers(
    bundle: ModelBundle,
    folder: str | Path,
    dtype: str | torch.dtype = "fp16",
    unet_state_override: dict[str, torch.Tensor] | None = None,
    source: TensorSource = LOCAL,
) -> Path:
    """Write a complete diffusers model folder that `from_pretrained` (and Tandem) can load.

    `unet_state_override` replaces the denoiser's weights (UNet or transformer; e.g. the EMA copy). The folder is written
    beside its final place and renamed in, so an existing output is replaced whole or not at all. Each
    weight file is written piece by piece (`streamed_save`); under sharded training every rank calls this
    with a `source` that gathers the sharded weights, and only the writing rank touches the disk.
    """
    torch_dtype = resolve_save_dtype(dtype)
    folder = Path(folder)
    _refuse_adapters(bundle)
    if unet_state_override is not None:
        _check_same_keys(bundle.denoiser.state_dict(), unet_state_override)
    with (atomic_directory(folder, replace=True) if source.writes else contextlib.nullcontext(folder)) as temp:
        for relative, part in diffusers_weight_files(bundle, unet_state_override):
            if source.writes:
                (temp / relative).parent.mkdir(parents=True, exist_ok=True)
            stream_file(temp / relative, [part], torch_dtype, {"format": "pt"}, source)
        if source.writes:
            _write_configs(bundle, temp, torch_dtype)
    return folder


def diffusers_weight_files(bundle: ModelBundle, unet_state_override: dict | None = None) -> list[tuple[str, FilePart]]:
    """(path in the folder, what it holds) of every weight file of the bundle's diffusers folder."""
    denoiser = bundle.denoiser
    denoiser_state = (lambda: dict(unet_state_override)) if unet_state_override is not None else denoiser.state_dict
    files = [(f"{bundle.family.denoiser_folder(bundle)}/{DIFFUSERS_WEIGHTS}",
              FilePart(denoiser, denoiser_state, dict, tuple(bundle.family.repeated_blocks(bundle)))),
             (f"vae/{DIFFUSERS_WEIGHTS}", FilePart(bundle.vae, bundle.vae.state_dict, dict))]
    for index, encoder in enumerate(bundle.text_encoders):
        # CLIP: checkpoint key names (with `text_model.`) load in transformers 4 and 5 alike.
        is_clip = type(encoder).__name__.startswith("CLIP")
        rename = (lambda state: {checkpoint_text_encoder_key(k): v for k, v in state.items()}) if is_clip else dict
        files.append((f"{text_encoder_name(index)}/model.safetensors",
                      FilePart(encoder, functools.partial(_untied, encoder), rename,
                               tuple(bundle.family.text_encoder_blocks(encoder)))))
    return files


def _write_configs(bundle: ModelBundle, folder: Path, dtype: torch.dtype) -> None:
    """Everything of the folder but the weights: configs, tokenizers, scheduler, model_index.json."""
    denoiser_folder = bundle.family.denoiser_folder(bundle)
    bundle.denoiser.save_config(folder / denoiser_folder)
    bundle.vae.save_config(folder / "vae")
    components = {denoiser_folder: bundle.denoiser, "vae": bundle.vae}
    for index, (encoder, tokenizer) in enumerate(zip(bundle.text_encoders, bundle.tokenizers)):
        name = text_encoder_name(index)
        config = encoder.config.to_dict()
        config["architectures"] = [type(encoder).__name__]
        config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (folder / name / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        tokenizer.save_pretrained(folder / name.replace("text_encoder", "tokenizer"))
        components[name] = encoder
        components[name.replace("text_encoder", "tokenizer")] = tokenizer
    scheduler = bundle.extra.get("scheduler", bundle.noise_scheduler)
    scheduler.save_pretrained(folder / "scheduler")
    components["scheduler"] = scheduler
    extras = {**bundle.family.model_index_extras(bundle), **bundle.family.write_extra_components(bundle, folder)}
    write_model_index(folder, bundle.family.info.pipeline_class, components, extras)
    for config in folder.rglob("*.json"):
        if config.name in _CONFIG_FILES:
            _drop_local_paths(config)


_CONFIG_FILES = ("config.json", "scheduler_config.json", "tokenizer_config.json", "processor_config.json",
                 "preprocessor_config.json", "special_tokens_map.json")
"""The small JSON files of a saved folder; the libraries record where a component was loaded from in them."""
_LOCAL_PATH_KEYS = ("_name_or_path", "name_or_path")


def _drop_local_paths(path: Path) -> None:
    """Remove the `_name_or_path` entries diffusers and transformers write (the folder the base model was
    loaded from, an absolute local path) from a saved JSON file: a shared model must not carry its trainer's
    folders, and nothing reads them back (loading records the new location)."""
    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if k not in _LOCAL_PATH_KEYS}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    data = json.loads(path.read_text(encoding="utf-8"))
    cleaned = clean(data)
    if cleaned != data:
        path.write_text(json.dumps(cleaned, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_full_single_file(
    bundle: ModelBundle,
    path: str | Path,
    dtype: str | torch.dtype = "fp16",
    unet_state_override: dict[str, torch.Tensor] | None = None,
    source: TensorSource = LOCAL,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write one `.safetensors` checkpoint in the layout of the family's original files (SD: LDM, as
    A1111/ComfyUI/Forge read it; SD3.5: Stability's; Flux and Flux.2: Black Forest Labs'; Chroma: its
    release's), piece by piece (`streamed_save`; `source` as for `save_full_diffusers`), with ModelSpec
    metadata (`lora_metadata.checkpoint_metadata`; `metadata` adds to it or replaces its values)."""
    from .lora_metadata import checkpoint_metadata

    _refuse_adapters(bundle)
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise ValueError(f"{path}: single files are written as .safetensors only; change the extension.")
    if unet_state_override is not None:
        _check_same_keys(bundle.denoiser.state_dict(), unet_state_override)
    parts, header = bundle.family.single_file_parts(bundle, unet_state_override)
    header = {**header, **checkpoint_metadata(bundle, path.stem), **(metadata or {})}
    return stream_file(path, parts, resolve_save_dtype(dtype), header, source)


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


def _untied(model) -> dict[str, torch.Tensor]:
    """The state dict without the copies of tied weights (T5's `encoder.embed_tokens` is `shared`):
    safetensors refuses two names for one tensor, and transformers ties them again when loading."""
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    return {key: value for key, value in model.state_dict().items() if key not in tied}


def write_model_index(folder: Path, pipeline_class: str, components: dict, extras: dict | None = None) -> None:
    """`model_index.json`: the pipeline class, each component's library and class (`components`: name -> the
    component, or its class), and `extras` (unused components, pipeline flags; may replace `_class_name`)."""
    import diffusers

    index = {"_class_name": pipeline_class, "_diffusers_version": diffusers.__version__}
    for name, component in components.items():
        cls = component if isinstance(component, type) else type(component)
        index[name] = ["diffusers" if cls.__module__.startswith("diffusers") else "transformers", cls.__name__]
    index.update(extras or {})
    (Path(folder) / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
