"""Load a base model (the demo, a diffusers folder or a single file) into a `ModelBundle`.

Every weight is read once, on the CPU, directly in its storage dtype, then moved to the target
device; nothing keeps a second copy. All modules come back frozen (`requires_grad=False`) and in
eval mode: the trainer unfreezes what it trains (see `lora.add_lora`, or the UNet for full training).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from modules.config.train_config import ModelConfig, TrainingConfig
from modules.config.validation import parse_config_overrides

from .bundle import MODEL_TYPES, ModelBundle
from .files import SAVE_DTYPES as DTYPES
from .variants import component_variant
PREDICTION_TYPES = ("epsilon", "v_prediction")
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
BUILTIN_DEMO = "builtin:demo"

# The UNet's cross-attention width is what tells the SD families apart (CLIP-L 768, OpenCLIP-H
# 1024, CLIP-L + OpenCLIP-bigG 2048).
_TYPE_BY_CROSS_ATTENTION_DIM = {768: "sd1", 1024: "sd2", 2048: "sdxl"}
_REQUIRED_FOLDER_FILES = (
    "model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json",
    "scheduler/scheduler_config.json",
)


def frozen_dtypes(model_cfg: ModelConfig, training_cfg: TrainingConfig | None = None) -> dict[str, torch.dtype]:
    """Storage dtype of each component: the configured ones for frozen parts, fp32 for trained ones.

    Without `training_cfg` nothing is trained (inference), so every configured dtype applies.
    LoRA keeps its base weights frozen, so `unet_dtype` applies to it; full training keeps fp32
    master weights (mixed precision happens in autocast).
    """
    for name in ("unet_dtype", "text_encoder_dtype", "vae_dtype"):
        value = getattr(model_cfg, name)
        if value not in DTYPES:
            raise ValueError(f"model.{name} is {value!r}; use one of {', '.join(DTYPES)}")
    full = training_cfg is not None and training_cfg.method == "full"
    trains_text = full and training_cfg.train_text_encoder
    return {
        "unet": torch.float32 if full else DTYPES[model_cfg.unet_dtype],
        "text_encoder": torch.float32 if trains_text else DTYPES[model_cfg.text_encoder_dtype],
        "vae": DTYPES[model_cfg.vae_dtype],
    }


def load_model(
    model_cfg: ModelConfig,
    device: torch.device | str = "cpu",
    training_cfg: TrainingConfig | None = None,
) -> ModelBundle:
    """Load `model_cfg.base_model` (and `model_cfg.vae_path`) into a frozen `ModelBundle` on `device`."""
    _check_choices(model_cfg)
    dtypes = frozen_dtypes(model_cfg, training_cfg)
    source = model_cfg.base_model.strip()
    if not source:
        raise ValueError(
            "model.base_model is empty; set it to a diffusers folder, a .safetensors/.ckpt file or builtin:demo")

    overrides = parse_config_overrides(model_cfg.config_overrides)  # validated: the message names the field
    # With a separate VAE the model's own is never read (no wasted time or memory).
    own_vae = not model_cfg.vae_path.strip()
    if source == BUILTIN_DEMO:
        from .demo import ensure_demo_model

        bundle = _load_folder(ensure_demo_model(), model_cfg, dtypes, BUILTIN_DEMO, own_vae)
    elif source.startswith("builtin:"):
        raise ValueError(f"model.base_model {source!r} is not a built-in model; the only one is {BUILTIN_DEMO}")
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"model.base_model {str(path)!r} does not exist; set it to a diffusers folder, "
                f"a .safetensors/.ckpt file or {BUILTIN_DEMO}"
            )
        if path.is_dir():
            bundle = _load_folder(path, model_cfg, dtypes, str(path.resolve()), own_vae)
        else:
            bundle = _load_single_file(path, model_cfg, dtypes, own_vae, overrides)

    if not own_vae:
        bundle.vae = load_vae(model_cfg.vae_path.strip(), dtypes["vae"], bundle.model_type, overrides.get("vae"))
        bundle.vae_source = str(Path(model_cfg.vae_path.strip()).expanduser().resolve())

    for module in bundle.modules().values():
        module.requires_grad_(False).eval()
    return bundle.to(device)


def load_vae(path_text: str, dtype: torch.dtype = torch.float32, model_type: str = "sd1", config: dict | None = None):
    """A VAE from a diffusers VAE folder, a model folder with `vae/`, or a single file.

    `model_type` is the base model's family: a single file does not say which latent scaling factor
    (SD 0.18215, SDXL 0.13025) its VAE was trained with; diffusers folders do. `config` (fields from
    `model.config_overrides["vae"]`) applies to a single file.
    """
    from diffusers import AutoencoderKL

    path = Path(path_text).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model.vae_path {str(path)!r} does not exist; set it to a VAE folder or file, or leave it empty")
    if path.is_file():
        from .single_file import load_vae_file

        return _as_dtype(load_vae_file(path, model_type=model_type, config=config), dtype)
    storage = next((name for name, value in DTYPES.items() if value == dtype), "fp16")
    if (path / "config.json").is_file():
        return AutoencoderKL.from_pretrained(path, local_files_only=True, torch_dtype=dtype,
                                             variant=component_variant(path, "vae", storage))
    if (path / "vae" / "config.json").is_file():
        return AutoencoderKL.from_pretrained(path, subfolder="vae", local_files_only=True, torch_dtype=dtype,
                                             variant=component_variant(path / "vae", "vae", storage))
    raise FileNotFoundError(
        f"model.vae_path {str(path)!r} is a folder without config.json or vae/config.json; "
        "point it at a diffusers VAE folder, a model folder that has one, or a .safetensors file"
    )


def detect_folder_model_type(folder: Path) -> tuple[str, str]:
    """(model type, reason) for a diffusers folder, from its model_index.json and UNet config."""
    index = json.loads((folder / "model_index.json").read_text())
    if index.get("text_encoder_2") and index["text_encoder_2"][0] is not None:
        return "sdxl", "it has a text_encoder_2"
    unet_config = json.loads((folder / "unet" / "config.json").read_text())
    dim = unet_config.get("cross_attention_dim")
    if dim in _TYPE_BY_CROSS_ATTENTION_DIM:
        return _TYPE_BY_CROSS_ATTENTION_DIM[dim], f"its UNet cross_attention_dim is {dim}"
    # Small research/demo models with one text encoder: the encoder's activation tells OpenCLIP (SD 2.x,
    # gelu) from OpenAI CLIP (SD 1.x, quick_gelu), as the two families' own folders record it.
    encoder_config = json.loads((folder / "text_encoder" / "config.json").read_text())
    if encoder_config.get("hidden_act") == "gelu":
        return "sd2", f"its one text encoder is OpenCLIP-style (gelu; UNet cross_attention_dim {dim})"
    return "sd1", f"it has one text encoder (UNet cross_attention_dim {dim})"


def _check_choices(model_cfg: ModelConfig) -> None:
    if model_cfg.model_type not in ("auto", *MODEL_TYPES):
        raise ValueError(f"model.model_type is {model_cfg.model_type!r}; use auto, {', '.join(MODEL_TYPES)}")
    if model_cfg.prediction_type not in ("auto", *PREDICTION_TYPES):
        raise ValueError(
            f"model.prediction_type is {model_cfg.prediction_type!r}; use auto, {', '.join(PREDICTION_TYPES)}")


def _resolve_model_type(requested: str, detected: str, reason: str, where: str) -> str:
    if requested not in ("auto", detected):
        raise ValueError(
            f"model.model_type is {requested!r} but {where} is an {detected.upper()} model ({reason}); "
            f"set model.model_type to 'auto' or {detected!r}"
        )
    return detected


def _load_folder(folder: Path, model_cfg: ModelConfig, dtypes: dict, source_name: str, own_vae: bool) -> ModelBundle:
    import diffusers
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    for relative in _REQUIRED_FOLDER_FILES:
        if not (folder / relative).is_file():
            raise FileNotFoundError(
                f"{folder} is not a diffusers model folder: {relative} is missing. Point model.base_model "
                "at the folder that holds model_index.json, or at a single .safetensors/.ckpt file"
            )
    detected, reason = detect_folder_model_type(folder)
    model_type = _resolve_model_type(model_cfg.model_type, detected, reason, str(folder))
    encoder_names = ["text_encoder", "text_encoder_2"] if model_type == "sdxl" else ["text_encoder"]
    for name in encoder_names:
        tokenizer_name = name.replace("text_encoder", "tokenizer")
        for relative in (f"{name}/config.json", tokenizer_name):
            if not (folder / relative).exists():
                raise FileNotFoundError(
                    f"{folder} is not a complete {model_type.upper()} diffusers folder: {relative} is missing")

    common = {"local_files_only": True}
    # fp16-only downloads (`*.fp16.safetensors`) need `variant`; each part is checked on its own.
    variant = {name: component_variant(folder / name, name, storage)
               for name, storage in [("unet", model_cfg.unet_dtype)] + ([("vae", model_cfg.vae_dtype)] if own_vae else [])
               + [(encoder, model_cfg.text_encoder_dtype) for encoder in encoder_names]}
    unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet", torch_dtype=dtypes["unet"],
                                                variant=variant["unet"], **common)
    vae = None
    if own_vae:
        vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", torch_dtype=dtypes["vae"],
                                            variant=variant["vae"], **common)
    text_encoders, tokenizers = [], []
    for name in encoder_names:
        model_class = CLIPTextModelWithProjection if name == "text_encoder_2" else CLIPTextModel
        tokenizer_name = name.replace("text_encoder", "tokenizer")
        text_encoders.append(model_class.from_pretrained(folder, subfolder=name, dtype=dtypes["text_encoder"],
                                                         variant=variant[name], **common))
        tokenizers.append(CLIPTokenizer.from_pretrained(folder, subfolder=tokenizer_name, **common))

    index = json.loads((folder / "model_index.json").read_text())
    scheduler_class_name = (index.get("scheduler") or [None, "DDPMScheduler"])[1]
    scheduler_class = getattr(diffusers, scheduler_class_name, diffusers.DDPMScheduler)
    scheduler = scheduler_class.from_pretrained(folder, subfolder="scheduler", **common)
    return _assemble(model_type, unet, vae, text_encoders, tokenizers, scheduler, model_cfg, source_name, folder)


def _load_single_file(path: Path, model_cfg: ModelConfig, dtypes: dict, own_vae: bool,
                      overrides: dict | None = None) -> ModelBundle:
    if path.suffix.lower() not in SINGLE_FILE_SUFFIXES:
        raise ValueError(
            f"model.base_model {str(path)!r} is a file but not a model checkpoint "
            f"({', '.join(SINGLE_FILE_SUFFIXES)}); point it at a checkpoint or a diffusers folder"
        )
    from .single_file import load_single_file_components

    parts = load_single_file_components(
        path, model_type=model_cfg.model_type, prediction_type=model_cfg.prediction_type,
        config_overrides=overrides, load_vae=own_vae)
    model_type = _resolve_model_type(model_cfg.model_type, parts["model_type"], "detected from its weights", str(path))
    encoders = [parts["text_encoder"]] + ([parts["text_encoder_2"]] if parts.get("text_encoder_2") is not None else [])
    tokenizers = [parts["tokenizer"]] + ([parts["tokenizer_2"]] if parts.get("tokenizer_2") is not None else [])
    for encoder, tokenizer in zip(encoders, tokenizers):
        if len(tokenizer) > encoder.config.vocab_size:
            # A single file stores no tokenizer, so the standard CLIP one is used; a model with its
            # own smaller vocabulary (Tandem's demo model, for one) cannot be read this way.
            raise ValueError(
                f"{path}: its text encoder knows {encoder.config.vocab_size} tokens but the standard CLIP "
                f"tokenizer has {len(tokenizer)}; the model was trained with its own tokenizer. Load it "
                "from its diffusers folder instead (save with save.full_format = diffusers)"
            )
    unet = _as_dtype(parts["unet"], dtypes["unet"])
    vae = _as_dtype(parts["vae"], dtypes["vae"]) if own_vae else None
    encoders = [_as_dtype(encoder, dtypes["text_encoder"]) for encoder in encoders]
    scheduler = parts["scheduler"]
    if parts.get("prediction_type") in PREDICTION_TYPES and model_cfg.prediction_type == "auto":
        scheduler = type(scheduler).from_config(scheduler.config, prediction_type=parts["prediction_type"])
    return _assemble(model_type, unet, vae, encoders, tokenizers, scheduler, model_cfg, str(path.resolve()), path)


def _as_dtype(module, dtype: torch.dtype):
    # Casting frees each old tensor as it goes; skipping a no-op cast also skips diffusers' warning.
    return module if next(module.parameters()).dtype == dtype else module.to(dtype)


def _assemble(
    model_type, unet, vae, text_encoders, tokenizers, scheduler, model_cfg, source_name, where,
) -> ModelBundle:
    from diffusers import DDPMScheduler

    prediction_type = model_cfg.prediction_type
    if prediction_type == "auto":
        prediction_type = scheduler.config.get("prediction_type", "epsilon")
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(
            f"{where}: its scheduler's prediction_type is {prediction_type!r}, which Tandem cannot train; "
            f"set model.prediction_type to one of {', '.join(PREDICTION_TYPES)}"
        )
    # Sampling and saving keep the model's own scheduler (with the trained prediction type).
    scheduler = type(scheduler).from_config(scheduler.config, prediction_type=prediction_type)
    noise_scheduler = DDPMScheduler.from_config(scheduler.config, prediction_type=prediction_type)
    return ModelBundle(
        model_type=model_type, unet=unet, vae=vae, text_encoders=text_encoders, tokenizers=tokenizers,
        noise_scheduler=noise_scheduler, prediction_type=prediction_type, source=source_name,
        extra={"scheduler": scheduler},
    )
