"""A quick look at the base model before any worker loads it: seconds, instead of a full load on every rank.

Reads only what tells a usable model from a broken one: a diffusers folder's `model_index.json`, a
weight file for each of its model parts and the headers of its `.safetensors` files; a single file's
key names - a `.safetensors` header (which also shows a truncated file) or a `.ckpt` through the
weights-only unpickler, memory-mapped, so no code in a pickle ever runs. The family is told by the
same facts the loaders use (`modules/families/registry.py`, `detect.py`), without importing the
model libraries, so the launcher stays fast. What passes here can still fail to load (a damaged
tensor inside an intact file, a part whose sizes do not fit its config); that shows when it is read.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from modules.families.registry import (BUILTIN_MODELS, FAMILIES, families_of_pipeline, family_of_keys,
                                           known_pipelines)
from modules.config.train_config import ModelConfig

from .detect import UNET_PREFIX, VAE_PREFIX, detect_model_type
from .pickled import load_pickled_state

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
NOT_MODEL_PARTS = ("Tokenizer", "Scheduler", "FeatureExtractor", "Processor")
"""Classes in a model_index.json that hold no weights (Flux.2-dev's tokenizer is a `PixtralProcessor`)."""


def probe_model(model_cfg: ModelConfig) -> str | None:
    """The family of `model.base_model` (None where only loading can tell SD 1.x from 2.x in a folder),
    after checking `model.vae_path` too. Raises ValueError (or FileNotFoundError) with one message
    naming the file, what is wrong and the fix."""
    families = probe_families(model_cfg)
    return families[0] if len(families) == 1 else None


def probe_families(model_cfg: ModelConfig) -> tuple[str, ...]:
    """The families `model.base_model` may be: one, or the few whose folders look alike (SD 1.x and 2.x)
    where only loading tells them apart. Checks as `probe_model`."""
    source = model_cfg.base_model.strip()
    own_vae = not model_cfg.vae_path.strip()
    if source.startswith("builtin:"):
        if source not in BUILTIN_MODELS:
            raise ValueError(f"model.base_model {source!r} is not a built-in model; the built-in ones are "
                             f"{', '.join(BUILTIN_MODELS)}.")
        families = (BUILTIN_MODELS[source],)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model.base_model {str(path)!r} does not exist; set it to a diffusers folder, "
                                    "a .safetensors/.ckpt file or builtin:demo.")
        candidates = _probe_folder(path, own_vae) if path.is_dir() else (_probe_file(path, own_vae),)
        _check_requested_type(model_cfg.model_type, candidates, path)
        families = tuple(candidates)
    if not own_vae:
        _probe_vae(Path(model_cfg.vae_path.strip()).expanduser())
    return families


def probe_lora_file(path: Path) -> None:
    """`training.lora_init`: the file's safetensors header, read alone (a damaged or cut-short file fails
    here, in the launcher, instead of in every worker after the model loaded). ValueError naming the field,
    the file and the fix."""
    try:
        keys = _safetensors_keys(path)
    except ValueError as e:
        reason = str(e).removeprefix(f"{path}: ").rstrip(".")
        raise ValueError(f"training.lora_init: {str(path)!r} is {reason}; or leave training.lora_init "
                         "empty to start the adapters afresh.") from None
    if not keys:
        raise ValueError(f"training.lora_init: {str(path)!r} holds no tensors, so no LoRA to start from; set it "
                         "to a LoRA .safetensors file or leave it empty.")


def _check_requested_type(requested: str, candidates: tuple[str, ...], path: Path) -> None:
    if requested == "auto" or requested in candidates:
        return
    found = " or ".join(c.upper() for c in candidates)
    choices = ", ".join(repr(c) for c in ("auto", *candidates))
    raise ValueError(f"model.model_type is {requested!r} but {path} is an {found} model; set "
                     f"model.model_type to one of {choices}.")


def _probe_folder(folder: Path, own_vae: bool) -> tuple[str, ...]:
    """The families the folder's pipeline class belongs to (SD 1.x and 2.x share one)."""
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise FileNotFoundError(
            f"{folder} is not a diffusers model folder: model_index.json is missing. Point model.base_model "
            "at the folder that holds model_index.json, or at a single .safetensors/.ckpt file.")
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
        if not isinstance(index, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{index_file}: not valid JSON ({e}); restore the folder from its source.") from None
    pipeline = index.get("_class_name")
    matches = families_of_pipeline(pipeline)
    if not matches:
        raise ValueError(f"{folder}: its model_index.json names pipeline {pipeline!r}, which Tandem does not "
                         f"train; supported: {known_pipelines()}.")
    for part, spec in index.items():
        if part.startswith("_") or not (isinstance(spec, list) and len(spec) == 2 and spec[1]):
            continue
        if any(kind in str(spec[1]) for kind in NOT_MODEL_PARTS) or (part == "vae" and not own_vae):
            continue
        weights = sorted(p for pattern in WEIGHT_PATTERNS for p in (folder / part).glob(pattern))
        if not weights:
            raise FileNotFoundError(f"{folder / part} holds no weights (.safetensors or .bin); the model folder "
                                    "is incomplete - download or copy it again.")
        for file in weights:
            if file.suffix == SAFETENSORS_SUFFIX:
                _safetensors_keys(file)
    return matches


def _probe_file(path: Path, own_vae: bool) -> str:
    if path.suffix.lower() not in SINGLE_FILE_SUFFIXES:
        raise ValueError(f"model.base_model {str(path)!r} is a file but not a model checkpoint "
                         f"({', '.join(SINGLE_FILE_SUFFIXES)}); point it at a checkpoint or a diffusers folder.")
    keys = _checkpoint_keys(path)
    found = family_of_keys(keys)  # the transformer families by their own key names, as the loader asks
    if found and FAMILIES[found].flow_matching:
        return found
    family = detect_model_type(keys, source=path)  # raises with the reason when it is no SD model
    if not any(k.startswith(UNET_PREFIX) for k in keys):
        raise ValueError(f"{path}: no UNet weights ({UNET_PREFIX}*) in the checkpoint.")
    if own_vae and not any(k.startswith(VAE_PREFIX) for k in keys):
        raise ValueError(f"{path}: the checkpoint has no VAE ({VAE_PREFIX}* keys); set model.vae_path to a VAE "
                         "file or folder.")
    return family


def _probe_vae(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"model.vae_path {str(path)!r} does not exist; set it to a VAE folder or file, "
                                "or leave it empty.")
    if path.is_file():
        _checkpoint_keys(path)
    elif not ((path / "config.json").is_file() or (path / "vae" / "config.json").is_file()):
        raise FileNotFoundError(f"model.vae_path {str(path)!r} is a folder without config.json or vae/config.json; "
                                "point it at a diffusers VAE folder, a model folder that has one, or a .safetensors file.")


def _checkpoint_keys(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == SAFETENSORS_SUFFIX:
        return _safetensors_keys(path)
    if suffix in PICKLE_SUFFIXES:
        return list(load_pickled_state(path))
    raise ValueError(f"{path}: unsupported checkpoint extension {path.suffix!r}; use .safetensors (preferred) or .ckpt.")


def _safetensors_keys(path: Path) -> list[str]:
    """The tensor names of a .safetensors file, reading its header only; the library checks that the
    header is sound and that the file holds every byte it promises (a truncated copy fails here)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable .safetensors file ({e}); it is damaged or incomplete - "
                         "download or copy it again.") from None
