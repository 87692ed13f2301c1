"""Load a base model (a built-in demo, a diffusers folder or a single file) into a `ModelBundle`.

Every weight is read once, on the CPU, directly in its storage dtype, then moved to the target
device; nothing keeps a second copy but the host tensors of the frozen parts that will wait in host memory
after the cache (`keep_on_host`, `host_copies.py`): they go back onto them instead of copying. All modules
come back frozen (`requires_grad=False`) and in eval mode: the trainer unfreezes what it trains (see
`lora.add_lora`, or the UNet for full training).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from modules.families.registry import BUILTIN_MODELS, FAMILIES, MODEL_TYPES, family_of_builtin, guess_family

from modules.config.train_config import ModelConfig, TrainingConfig
from modules.config.validation import parse_config_overrides
from modules.util import dist_utils as du

from .bundle import ModelBundle
from .families import detect_checkpoint, detect_folder
from .families import family as get_family
from .families.sd import PREDICTION_TYPES, REQUIRED_FOLDER_FILES
from .files import SAVE_DTYPES as DTYPES
from .files import as_dtype  # noqa: F401 - re-exported: family loaders written against loading.as_dtype keep working
from .variants import component_variant

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
BUILTIN_DEMO = "builtin:demo"


FLOAT8_BASE = "fp8"
"""`model.unet_dtype` for a denoiser whose Linear weights are stored in float8 (`float8.py`); the rest is bf16."""


def frozen_dtypes(model_cfg: ModelConfig, training_cfg: TrainingConfig | None = None) -> dict[str, torch.dtype]:
    """Storage dtype of each component: the configured ones for frozen parts, fp32 for trained ones.

    Without `training_cfg` nothing is trained (inference), so every configured dtype applies.
    LoRA keeps its base weights frozen, so `unet_dtype` applies to it; full training keeps fp32
    master weights (mixed precision happens in autocast). `unet_dtype` fp8 loads the denoiser in bf16;
    `store_base_in_float8` then stores its Linear weights in float8.
    """
    for name in ("unet_dtype", "text_encoder_dtype", "vae_dtype"):
        value = getattr(model_cfg, name)
        # fp8 text encoders: the families that encode text apart store them so (text_apart.py); the rest refuse it
        allowed = (*DTYPES, FLOAT8_BASE) if name in ("unet_dtype", "text_encoder_dtype") else tuple(DTYPES)
        if value not in allowed:
            raise ValueError(f"model.{name} is {value!r}; use one of {', '.join(allowed)}")
    full = training_cfg is not None and training_cfg.method == "full"
    if full and model_cfg.unet_dtype == FLOAT8_BASE:
        raise ValueError("model.unet_dtype is 'fp8', which stores a frozen LoRA base; a full fine-tune trains "
                         "every weight (in fp32): set model.unet_dtype to fp32 or training.method to lora")
    trains_text = full and training_cfg.train_text_encoder
    unet = torch.bfloat16 if model_cfg.unet_dtype == FLOAT8_BASE else DTYPES.get(model_cfg.unet_dtype)
    return {
        "unet": torch.float32 if full else unet,
        "text_encoder": torch.float32 if trains_text else DTYPES.get(model_cfg.text_encoder_dtype, torch.bfloat16),
        "vae": DTYPES[model_cfg.vae_dtype],
    }


def load_model(
    model_cfg: ModelConfig,
    device: torch.device | str = "cpu",
    training_cfg: TrainingConfig | None = None,
    keep_on_host: frozenset[str] = frozenset(),
    parts: dict[str, float] | None = None,
) -> ModelBundle:
    """Load `model_cfg.base_model` (and `model_cfg.vae_path`) into a frozen `ModelBundle` on `device`.

    `keep_on_host` ("vae", "text_encoders"): parts that will wait in host memory after the cache, whose host
    tensors are kept to go back onto (`host_copies.py`) when `device` is a GPU. `parts`, when given, gets
    where the load's time went (seconds): importing diffusers, reading the weights (with the model classes'
    own imports), moving them to the device - the start-up's `model` phase in parts.

    The family is detected from the folder or the file (`modules.model.families`), checked against an
    explicit `model.model_type`, and does the loading itself.
    """
    _check_choices(model_cfg)
    dtypes = frozen_dtypes(model_cfg, training_cfg)
    source = model_cfg.base_model.strip()
    if not source:
        raise ValueError(
            "model.base_model is empty; set it to a diffusers folder, a .safetensors/.ckpt file or builtin:demo")

    overrides = parse_config_overrides(model_cfg.config_overrides)  # validated: the message names the field
    # With a separate VAE the model's own is never read (no wasted time or memory).
    own_vae = not model_cfg.vae_path.strip()
    started = time.perf_counter()
    import diffusers  # noqa: F401 - every family's models are diffusers'; its import is a part of its own
    imported = time.perf_counter()
    family, where, kind = resolve_family(model_cfg)
    if kind == "file":
        bundle = family.load_single_file(where, model_cfg, dtypes, own_vae)
    else:
        bundle = family.load_folder(where, model_cfg, dtypes, source if kind == "builtin" else str(where.resolve()),
                                    own_vae)

    if not own_vae:
        bundle.vae = load_vae(model_cfg.vae_path.strip(), dtypes["vae"], bundle.model_type, overrides.get("vae"))
        bundle.vae_source = str(Path(model_cfg.vae_path.strip()).expanduser().resolve())

    if training_cfg is not None and training_cfg.clip_skip:
        bundle.extra["clip_skip"] = bundle.family.checked_clip_skip(training_cfg.clip_skip)
    for module in bundle.modules().values():
        module.requires_grad_(False).eval()
    store_base_in_float8(bundle, model_cfg)  # on the CPU: the device never holds the bf16 weights
    read = time.perf_counter()
    device_type = torch.device(device).type
    if device_type == "cuda":
        from .host_copies import keep_host_copies
        keep_host_copies(bundle, keep_on_host)
    bundle = bundle.to(device)
    if parts is not None:
        parts.update({"importing diffusers": imported - started, "reading the weights": read - imported,
                      f"to the {'GPU' if device_type == 'cuda' else device_type.upper()}": time.perf_counter() - read})
    return bundle


def build_builtin_first(model_cfg: ModelConfig) -> None:
    """Make sure a built-in model's files exist before any rank loads it; nothing for a model on disk.

    Only rank 0 of a process group can write them (transformers saves a model on rank 0 alone): rank 0 builds
    what is missing first, the other ranks then find them complete, and every rank can load at the same time,
    where loading in turn took N loads' time."""
    if model_cfg.base_model.strip().startswith("builtin:"):
        with du.main_first():
            resolve_family(model_cfg)


def resolve_family(model_cfg: ModelConfig):
    """(family, where, kind) of `model.base_model` without reading any weight: kind `builtin` (where: its
    folder, built on first use), `folder` or `file`. Refuses what the family cannot take (a type other than
    `model.model_type` names, an fp8 text encoder of a family that loads its text encoders with the model)."""
    _check_choices(model_cfg)
    source = model_cfg.base_model.strip()
    if not source:
        raise ValueError(
            "model.base_model is empty; set it to a diffusers folder, a .safetensors/.ckpt file or builtin:demo")
    if source.startswith("builtin:"):
        name = family_of_builtin(source)
        if name is None:
            known = ", ".join(BUILTIN_MODELS)
            raise ValueError(f"model.base_model {source!r} is not a built-in model; the built-in ones are {known}")
        family = get_family(_resolve_model_type(model_cfg.model_type, name, f"{source} is built in", source))
        found = (family, family.build_demo(), "builtin")
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"model.base_model {str(path)!r} does not exist; set it to a diffusers folder, "
                f"a .safetensors/.ckpt file or {BUILTIN_DEMO}"
            )
        if path.is_dir():
            name, reason = _detect_folder(path)
            found = (get_family(_resolve_model_type(model_cfg.model_type, name, reason, str(path))), path, "folder")
        else:
            found = (_single_file_family(path, model_cfg), path, "file")
    if model_cfg.text_encoder_dtype == FLOAT8_BASE and not found[0].info.text_apart:
        raise ValueError(f"model.text_encoder_dtype is 'fp8', which only the families whose text encoder is loaded "
                         f"apart take (Qwen-Image, Z-Image); {found[0].info.title} loads its text encoders with the "
                         "model: set model.text_encoder_dtype to bf16")
    return found


def load_text_side(model_cfg: ModelConfig, training_cfg: TrainingConfig | None = None) -> ModelBundle | None:
    """The bundle of a `text_apart` family without its denoiser: VAE, tokenizer and the text side
    (`text_apart.py`), enough to fill the text cache before the denoiser loads (same `fingerprint()` as the
    whole bundle); None for the other families."""
    guessed = FAMILIES.get(guess_family(model_cfg.base_model, model_cfg.model_type) or "")
    if guessed is None or not guessed.text_apart:  # read without loading (or building) anything
        return None
    family, where, kind = resolve_family(model_cfg)
    if not family.info.text_apart:
        return None
    own_vae = not model_cfg.vae_path.strip()
    dtypes = frozen_dtypes(model_cfg, training_cfg)
    source = model_cfg.base_model.strip() if kind == "builtin" else str(where.resolve())
    bundle = family.load_text_side(where, kind, model_cfg, dtypes, source, own_vae)
    if not own_vae:
        overrides = parse_config_overrides(model_cfg.config_overrides)
        bundle.vae = load_vae(model_cfg.vae_path.strip(), dtypes["vae"], bundle.model_type, overrides.get("vae"))
        bundle.vae_source = str(Path(model_cfg.vae_path.strip()).expanduser().resolve())
    return bundle


def store_base_in_float8(bundle: ModelBundle, model_cfg: ModelConfig) -> None:
    """With `model.unet_dtype` fp8: the denoiser's Linear weights in float8 (frozen; see float8.py)."""
    if model_cfg.unet_dtype != FLOAT8_BASE:
        return
    from .float8 import store_linear_weights_in_float8
    if not store_linear_weights_in_float8(bundle.denoiser, f"the {bundle.denoiser_name}"):
        raise ValueError(f"model.unet_dtype is 'fp8', but the {bundle.denoiser_name} has no Linear layer to store "
                         "in float8; set model.unet_dtype to bf16")


def load_vae(path_text: str, dtype: torch.dtype = torch.float32, model_type: str = "sd1", config: dict | None = None):
    """A VAE from a diffusers VAE folder, a model folder with `vae/`, or a single file.

    `model_type` is the base model's family: a single file does not say which latent scaling factor
    (SD 0.18215, SDXL 0.13025, SD3 1.5305, Flux 0.3611) its VAE was trained with; diffusers folders do.
    `config` (fields from `model.config_overrides["vae"]`) applies to a single file.
    """
    import diffusers

    path = Path(path_text).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model.vae_path {str(path)!r} does not exist; set it to a VAE folder or file, or leave it empty")
    if path.is_file():
        return get_family(model_type).load_vae(path, dtype, config)
    storage = next((name for name, value in DTYPES.items() if value == dtype), "fp16")
    for folder in (path, path / "vae"):
        if (folder / "config.json").is_file():
            # The class the folder's config names (Flux.2's VAE is an AutoencoderKLFlux2).
            name = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("_class_name", "")
            cls = getattr(diffusers, name, None) if name.startswith("Autoencoder") else None
            return (cls or diffusers.AutoencoderKL).from_pretrained(
                folder, local_files_only=True, torch_dtype=dtype, variant=component_variant(folder, "vae", storage))
    raise FileNotFoundError(
        f"model.vae_path {str(path)!r} is a folder without config.json or vae/config.json; "
        "point it at a diffusers VAE folder, a model folder that has one, or a .safetensors file"
    )


def detect_folder_model_type(folder: Path) -> tuple[str, str]:
    """(model type, reason) for a diffusers folder, from its model_index.json and component configs."""
    return detect_folder(Path(folder))


def _detect_folder(folder: Path) -> tuple[str, str]:
    """The folder's family; a folder that is no diffusers model names its first missing file."""
    if (folder / "model_index.json").is_file():
        try:
            return detect_folder(folder)
        except ValueError:
            if (folder / "transformer").is_dir() or (folder / "unet").is_dir():
                raise
    for relative in REQUIRED_FOLDER_FILES:
        if not (folder / relative).is_file():
            raise FileNotFoundError(
                f"{folder} is not a diffusers model folder: {relative} is missing. Point model.base_model "
                "at the folder that holds model_index.json, or at a single .safetensors/.ckpt file"
            )
    return detect_folder(folder)


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


def _edit_model_of(detected: str | None, model_cfg: ModelConfig) -> str | None:
    """An edit model's single file has its base family's names (Qwen-Image-Edit's are Qwen-Image's): the edit family
    the config names, or whose folder `model.components_folder` is, when it trains the same denoiser class."""
    if detected not in FAMILIES:
        return detected
    candidates = [model_cfg.model_type]
    components = model_cfg.components_folder.strip()
    if components and (Path(components).expanduser() / "model_index.json").is_file():
        try:
            candidates.append(detect_folder(Path(components).expanduser())[0])
        except ValueError:
            pass  # no family's folder: the family's own check names it
    for name in candidates:
        if name in FAMILIES and FAMILIES[name].controls and \
                FAMILIES[name].denoiser_class == FAMILIES[detected].denoiser_class:
            return name
    return detected


def _single_file_family(path: Path, model_cfg: ModelConfig):
    if path.suffix.lower() not in SINGLE_FILE_SUFFIXES:
        raise ValueError(
            f"model.base_model {str(path)!r} is a file but not a model checkpoint "
            f"({', '.join(SINGLE_FILE_SUFFIXES)}); point it at a checkpoint or a diffusers folder"
        )
    from .single_file import checkpoint_keys

    detected = _edit_model_of(detect_checkpoint(checkpoint_keys(path), source=path), model_cfg)
    sd_types = [name for name, info in FAMILIES.items() if not info.flow_matching]
    if not (model_cfg.model_type in sd_types and detected in sd_types):
        _resolve_model_type(model_cfg.model_type, detected, "detected from its weights", str(path))
    # Between SD types the SD loader checks an explicit type against the file, with its own message.
    return get_family(detected)
