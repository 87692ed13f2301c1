"""Stable Diffusion single-file checkpoints (original "LDM" layout) in and out, fully offline.

Loading: read the file, detect the family from its keys (`detect.py`), convert each part with
diffusers' own `single_file_utils` converters, and load it into a model that was built with its
parameters on the `meta` device, with `assign=True`: the converted tensors become the model's
parameters, so RAM holds the weights once, never twice. Configs come from, first match wins:
`config_overrides` > the configs Tandem recorded in the file's metadata when it wrote it > the
real-size configs shipped in `configs/<model_type>/`.

Saving is the exact reverse (diffusers -> LDM key maps written here, OpenCLIP q/k/v fused back into
`in_proj`), written atomically. `save_single_file` followed by `load_single_file_components` gives
back identical tensors.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.loaders.single_file_utils import (
    convert_ldm_clip_checkpoint,
    convert_ldm_unet_checkpoint,
    convert_ldm_vae_checkpoint,
    convert_open_clip_checkpoint,
)
from safetensors import SafetensorError, safe_open
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from modules.model.detect import (
    MODEL_TYPES,
    SD1_TEXT_PREFIX,
    SD2_TEXT_PREFIX,
    SDXL_TEXT_2_PREFIX,
    SDXL_TEXT_PREFIX,
    UNET_PREFIX,
    V_PRED_MARKER_KEY,
    VAE_PREFIX,
    detect_model_type,
    resolve_prediction_type,
)
from modules.model.ldm_layout import clip_to_ldm, open_clip_to_ldm, unet_to_ldm, vae_to_ldm  # noqa: F401 (re-exported)
from modules.model.files import resolve_save_dtype
from modules.model.pickled import load_pickled_state
from modules.model.tokenizer import OPEN_CLIP_PAD_TOKEN, clip_tokenizer
from modules.model.streamed_save import LOCAL, FilePart, stream_file

CONFIG_DIR = Path(__file__).parent / "configs"
COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")
SAFETENSORS_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth")
# safetensors metadata keys Tandem writes (strings only, ignored by other tools).
META_MODEL_TYPE = "tandem.model_type"
META_PREDICTION_TYPE = "tandem.prediction_type"
META_CONFIGS = "tandem.configs"
# The CLIPTextConfig fields that decide the shape and behaviour of a text encoder; the rest is
# bookkeeping that would only tie files to one transformers version.
CLIP_CONFIG_FIELDS = (
    "vocab_size", "max_position_embeddings", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_hidden_layers", "hidden_act", "projection_dim", "layer_norm_eps", "bos_token_id", "eos_token_id",
    "pad_token_id",
)
_TEXT_PREFIXES = {  # model_type -> one LDM prefix per text encoder, in bundle order
    "sd1": (SD1_TEXT_PREFIX,),
    "sd2": (SD2_TEXT_PREFIX,),
    "sdxl": (SDXL_TEXT_PREFIX, SDXL_TEXT_2_PREFIX),
}
_WANTED_PREFIXES = (UNET_PREFIX, VAE_PREFIX, "cond_stage_model.", "conditioner.embedders.")
_PART_NAMES = {"UNet": "unet", "VAE": "vae", "text encoder": "text_encoder", "second text encoder": "text_encoder_2"}


# ------------------------------------------------------------------------------------------ reading


def read_checkpoint(path: str | Path, prefixes: tuple[str, ...] | None = None) -> tuple[dict, dict]:
    """(state dict, safetensors metadata) of a `.safetensors` or `.ckpt`/`.pt`/`.pth` file. With
    `prefixes`, only keys starting with one of them are read (skips EMA copies, training losses)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint file not found. Check model.base_model / model.vae_path.")
    wanted = lambda key: prefixes is None or key.startswith(prefixes) or key == V_PRED_MARKER_KEY  # noqa: E731
    suffix = path.suffix.lower()
    if suffix in SAFETENSORS_SUFFIXES:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                metadata = dict(f.metadata() or {})
                return {k: f.get_tensor(k) for k in f.keys() if wanted(k)}, metadata
        except SafetensorError as error:
            raise ValueError(f"{path}: not a readable .safetensors file ({error}).") from error
    if suffix in PICKLE_SUFFIXES:
        return {k: v for k, v in load_pickled_state(path).items() if wanted(k)}, {}
    raise ValueError(
        f"{path}: unsupported checkpoint extension {path.suffix!r}; use .safetensors (preferred) or .ckpt."
    )


def checkpoint_keys(path: str | Path) -> list[str]:
    """The tensor names of a checkpoint file (a .safetensors header is read without its tensors)."""
    path = Path(path)
    if path.suffix.lower() in SAFETENSORS_SUFFIXES:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                return list(f.keys())
        except SafetensorError as error:
            raise ValueError(f"{path}: not a readable .safetensors file ({error}).") from error
    return list(read_checkpoint(path)[0])


# ------------------------------------------------------------------------------------------ configs


def shipped_config(model_type: str, component: str) -> dict:
    """The real-size diffusers/transformers config of `component` for `model_type` (configs/<type>/)."""
    path = CONFIG_DIR / model_type / f"{component}.json"
    if not path.is_file():
        raise ValueError(f"no shipped {component} config for model type {model_type!r} ({path}).")
    return json.loads(path.read_text(encoding="utf-8"))


def _resolve_configs(model_type: str, metadata: dict, overrides: Mapping[str, Mapping] | None) -> dict:
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(COMPONENTS))
    if unknown:
        raise ValueError(f"config_overrides: unknown component(s) {unknown}; use {', '.join(COMPONENTS)}.")
    recorded = json.loads(metadata[META_CONFIGS]) if META_CONFIGS in metadata else {}
    names = COMPONENTS if model_type == "sdxl" else COMPONENTS[:3]
    return {
        name: {**(recorded.get(name) or shipped_config(model_type, name)), **overrides.get(name, {})}
        for name in names
    }


def _model_config(model) -> dict:
    """The config to record in a saved file, JSON-ready."""
    if isinstance(model, (CLIPTextModel, CLIPTextModelWithProjection)):
        return {name: getattr(model.config, name) for name in CLIP_CONFIG_FIELDS}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in model.config.items() if not k.startswith("_")}


# ------------------------------------------------------------------------------------------ building


@contextlib.contextmanager
def _parameters_on_meta():
    """Create modules with their parameters on `meta` (no memory, no init cost) but buffers real:
    non-persistent buffers such as CLIP's `position_ids` are not in any checkpoint, so they must
    be built normally. (The same trick as accelerate's `init_empty_weights(include_buffers=False)`.)"""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            meta = module._parameters[name].to("meta")
            module._parameters[name] = torch.nn.Parameter(meta, requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _build(cls, config: dict):
    with _parameters_on_meta():
        if issubclass(cls, (CLIPTextModel, CLIPTextModelWithProjection)):
            return cls(CLIPTextConfig(**{k: v for k, v in config.items() if k in CLIP_CONFIG_FIELDS}))
        return cls.from_config(config)


def _load_weights(model, state: dict, source: Path, component: str):
    """Load `state` into a meta-built `model` by assignment; mismatches become one readable error."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(state[k].shape) != tuple(expected[k]))
    if missing or unexpected or wrong:
        problems = []
        if wrong:
            problems.append("shape mismatch " + ", ".join(
                f"{k} {tuple(state[k].shape)} vs config {tuple(expected[k])}" for k in wrong[:3]))
        if missing:
            problems.append(f"{len(missing)} missing, e.g. {', '.join(missing[:3])}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected, e.g. {', '.join(unexpected[:3])}")
        part = _PART_NAMES.get(component, component)
        raise ValueError(
            f"{source}: the {component} weights do not fit the standard {component} config ({'; '.join(problems)}). "
            f"A checkpoint with non-standard sizes loads with model.config_overrides giving them as JSON, e.g. "
            f'{{"{part}": {{"attention_head_dim": 8}}}} (GUI: Model tab, Advanced; command line: '
            "--config-value 'model.config_overrides=<JSON>'), with the fields of that part's config.json in a "
            "diffusers copy of the same model (docs/Models.md, 'Non-standard sizes'); or point "
            "model.base_model at such a diffusers folder."
        )
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _clip_keys_for(model, canonical: dict) -> dict:
    """Converters speak `text_model.*`; newer transformers flatten `CLIPTextModel` (no `text_model.`)."""
    canonical = {k: v for k, v in canonical.items() if not k.endswith("embeddings.position_ids")}
    if hasattr(model, "text_model"):
        return canonical
    return {k.removeprefix("text_model."): v for k, v in canonical.items()}


def _canonical_keys(model, state: dict) -> dict:
    """`state` (of `model`, or a part of it) with `text_model.` prefixes whatever the transformers version."""
    if hasattr(model, "text_model"):
        return state
    return {k if k.startswith("text_projection") else "text_model." + k: v for k, v in state.items()}


def _load_text_encoder(cls, config: dict, state: dict, prefix: str, source: Path, name: str):
    model = _build(cls, config)
    if not any(k.startswith(prefix) for k in state):
        raise ValueError(f"{source}: no {name} weights ({prefix}*) in the checkpoint.")
    if prefix in (SD1_TEXT_PREFIX, SDXL_TEXT_PREFIX):
        converted = convert_ldm_clip_checkpoint({k: v for k, v in state.items() if k.startswith(prefix)})
    else:
        converted = convert_open_clip_checkpoint(model, state, prefix=prefix)
    return _load_weights(model, _clip_keys_for(model, converted), source, name)


def _load_vae_from_state(state: dict, config: dict, source: Path) -> AutoencoderKL:
    vae = _build(AutoencoderKL, config)
    if any(k.startswith(("encoder.down_blocks.", "decoder.up_blocks.")) for k in state):
        converted = state  # already diffusers layout (a VAE taken from a diffusers folder)
    else:
        converted = convert_ldm_vae_checkpoint(state, config)
    return _load_weights(vae, converted, source, "VAE")


# ------------------------------------------------------------------------------------------ public API


def load_single_file_components(
    path: str | Path,
    model_type: str = "auto",
    prediction_type: str = "auto",
    config_overrides: Mapping[str, Mapping[str, Any]] | None = None,
    load_vae: bool = True,
) -> dict:
    """Load an original-layout SD 1.x / 2.x / SDXL checkpoint into diffusers/transformers models.

    Returns {unet, vae, text_encoder, text_encoder_2 (None unless SDXL), tokenizer, tokenizer_2,
    scheduler (DDPMScheduler), model_type, prediction_type}. Tensors keep the file's dtype.
    `config_overrides`: {component: {field: value}} merged over the configs (for checkpoints with
    non-standard sizes). `load_vae=False` skips the VAE (vae=None) when another VAE replaces it.
    """
    path = Path(path)
    if model_type != "auto" and model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of auto, {', '.join(MODEL_TYPES)}.")
    state, metadata = read_checkpoint(path, _WANTED_PREFIXES)
    detected = detect_model_type(state.keys(), source=path)
    if model_type != "auto" and model_type != detected:
        raise ValueError(
            f"{path}: model.model_type is {model_type!r} but the checkpoint is {detected!r} (from its text "
            f"encoder keys). Set model.model_type to {detected!r} or 'auto', or pick the right file."
        )
    prediction = resolve_prediction_type(
        prediction_type, detected, path, state, recorded=metadata.get(META_PREDICTION_TYPE)
    )
    configs = _resolve_configs(detected, metadata, config_overrides)

    if not any(k.startswith(UNET_PREFIX) for k in state):
        raise ValueError(f"{path}: no UNet weights ({UNET_PREFIX}*) in the checkpoint.")
    unet = _load_weights(
        _build(UNet2DConditionModel, configs["unet"]), convert_ldm_unet_checkpoint(state, configs["unet"]),
        path, "UNet",
    )
    vae = None
    if load_vae:
        vae_state = {k: v for k, v in state.items() if k.startswith(VAE_PREFIX)}
        if not vae_state:
            raise ValueError(
                f"{path}: the checkpoint has no VAE ({VAE_PREFIX}* keys); set model.vae_path to a VAE file or folder."
            )
        vae = _load_vae_from_state(vae_state, configs["vae"], path)

    prefixes = _TEXT_PREFIXES[detected]
    text_encoder = _load_text_encoder(CLIPTextModel, configs["text_encoder"], state, prefixes[0], path, "text encoder")
    text_encoder_2 = None
    if detected == "sdxl":
        text_encoder_2 = _load_text_encoder(
            CLIPTextModelWithProjection, configs["text_encoder_2"], state, prefixes[1], path, "second text encoder"
        )
    del state  # the models now own every tensor that was kept

    scheduler = DDPMScheduler.from_config({**shipped_config(detected, "scheduler"), "prediction_type": prediction})
    return {
        "unet": unet,
        "vae": vae,
        "text_encoder": text_encoder,
        "text_encoder_2": text_encoder_2,
        "tokenizer": clip_tokenizer(OPEN_CLIP_PAD_TOKEN if detected == "sd2" else "<|endoftext|>"),
        "tokenizer_2": clip_tokenizer(OPEN_CLIP_PAD_TOKEN) if detected == "sdxl" else None,
        "scheduler": scheduler,
        "model_type": detected,
        "prediction_type": prediction,
    }


def load_vae_file(
    path: str | Path, model_type: str = "sd1", config: Mapping[str, Any] | None = None
) -> AutoencoderKL:
    """A VAE from a single file: a VAE-only file (original or diffusers layout) or a full checkpoint
    (its `first_stage_model.*`). SD and SDXL VAEs have identical shapes and differ only in their latent
    scaling factor, so pass the base model's `model_type` (SD3 and Flux: their 16-channel VAEs);
    `config` overrides config fields."""
    path = Path(path)
    if not (CONFIG_DIR / model_type / "vae.json").is_file():
        raise ValueError(f"model_type {model_type!r} has no shipped VAE config; use one of "
                         f"{', '.join(sorted(p.parent.name for p in CONFIG_DIR.glob('*/vae.json')))}.")
    state, metadata = read_checkpoint(path)
    if any(k.startswith(VAE_PREFIX) for k in state):
        state = {k: v for k, v in state.items() if k.startswith(VAE_PREFIX)}
    elif any(k.startswith("vae.") for k in state):
        state = {k: v for k, v in state.items() if k.startswith("vae.")}
    if not any(k.startswith(("encoder.", "decoder.", VAE_PREFIX, "vae.")) for k in state):
        raise ValueError(
            f"{path}: no VAE weights found (expected encoder.*/decoder.* or {VAE_PREFIX}* keys); "
            f"first keys: {', '.join(sorted(state)[:5])}"
        )
    recorded = json.loads(metadata[META_CONFIGS]).get("vae") if META_CONFIGS in metadata else None
    vae_config = {**(recorded or shipped_config(model_type, "vae")), **dict(config or {})}
    return _load_vae_from_state(state, vae_config, path)


def save_single_file(
    bundle, path: str | Path, dtype: torch.dtype | str, unet_state_override: Mapping | None = None
) -> Path:
    """Write the UNet, VAE and text encoder(s) of a `ModelBundle` as one original-layout `.safetensors`
    (loadable by A1111, ComfyUI, diffusers' `from_single_file`), atomically. `unet_state_override`: a
    diffusers-layout UNet state dict to write instead of `bundle.unet`'s (e.g. LoRA merged in)."""
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise ValueError(f"{path}: single files are written as .safetensors only; change the extension.")
    parts, metadata = single_file_parts(bundle, unet_state_override)
    return stream_file(path, parts, resolve_save_dtype(dtype), metadata, LOCAL)


def single_file_parts(bundle, unet_state_override: Mapping | None = None) -> tuple[list[FilePart], dict[str, str]]:
    """The parts of an SD single file (UNet, VAE, text encoders, each with its LDM renaming) and its
    metadata; written whole or, under sharded training, block by block (`streamed_save`)."""
    from modules.model.families import family

    blocks = family(bundle.model_type)
    unet, vae = bundle.unet, bundle.vae
    unet_state = unet.state_dict
    if unet_state_override is not None:
        expected = set(unet.state_dict())
        if set(unet_state_override) != expected:
            diff = sorted(set(unet_state_override) ^ expected)
            raise ValueError(
                f"unet_state_override does not match the UNet's keys ({len(diff)} differ, e.g. {', '.join(diff[:3])}); "
                "merge LoRA weights into a plain diffusers UNet state dict first."
            )
        unet_state = lambda: dict(unet_state_override)  # noqa: E731
    parts = [FilePart(unet, unet_state, lambda state: unet_to_ldm(state, unet.config), tuple(blocks.repeated_blocks(bundle))),
             FilePart(vae, vae.state_dict, lambda state: vae_to_ldm(state, vae.config))]
    configs = {"unet": _model_config(unet), "vae": _model_config(vae)}
    prefixes = _TEXT_PREFIXES[bundle.model_type]
    for index, (prefix, encoder) in enumerate(zip(prefixes, bundle.text_encoders, strict=True)):
        parts.append(FilePart(encoder, encoder.state_dict, functools.partial(_encoder_to_ldm, encoder, prefix),
                              tuple(blocks.text_encoder_blocks(encoder))))
        configs["text_encoder" if index == 0 else "text_encoder_2"] = _model_config(encoder)
    metadata = {
        "format": "pt",
        META_MODEL_TYPE: bundle.model_type,
        META_PREDICTION_TYPE: bundle.prediction_type,
        META_CONFIGS: json.dumps(configs),
    }
    return parts, metadata


def _encoder_to_ldm(encoder, prefix: str, state: dict) -> dict:
    canonical = _canonical_keys(encoder, state)
    is_openai_clip = prefix.endswith("transformer.")
    return clip_to_ldm(canonical, prefix) if is_openai_clip else open_clip_to_ldm(canonical, prefix)
