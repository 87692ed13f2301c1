"""The memory estimate's torch side: sizing what no file describes, and the report `check_multi_gpu` prints.

The estimate itself is torch-free (`modules/planning/model_sizes.py` reads a model's sizes from its files or
the published sizes Tandem ships; `memory_need.py` adds up what a GPU holds; `memory_plan.py` chooses the
plan). What needs torch lives here: building a component on PyTorch's `meta` device (shapes only, no
memory, no download) when neither its files nor a stored size describe it - the result is kept in
`$TANDEM_HOME/sizes/`, so that happens once per architecture and machine - building a built-in model's
folder, and telling a single file's family by the model layer's rules (whose errors name refiners and
diffusers-layout files). `write_shipped_sizes` (`python -m modules.distributed.memory_estimate`) writes
the published sizes of every config in `modules/model/configs/`.
"""
from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import torch

from modules.planning import memory_need
from modules.planning.memory_need import GIB, EstimateError, Setup, facts, need  # noqa: F401 - EstimateError re-exported
from modules.families.registry import FAMILIES
from modules.planning.model_sizes import (CONFIGS_DIR, SHIPPED_SIZES_DIR, Component, ModelSizes, SizesUnavailable,
                                        counted_parts, model_sizes, store_component)

# The published parameter counts of the Stable Diffusion architectures Tandem ships configs for
# (modules/model/configs/<type>/); tests build those configs on `meta` and compare.
PUBLISHED_PARAMS_M = {"sd1": {"unet": 859.5, "text_encoder": 123.1},
                      "sd2": {"unet": 865.9, "text_encoder": 340.4},
                      "sdxl": {"unet": 2567.5, "text_encoder": 123.1, "text_encoder_2": 694.7}}


def _known_args(cls, config: dict) -> dict:
    """The entries of a diffusers `config.json` that the class accepts (drops `_class_name` etc.)."""
    names = set(inspect.signature(cls.__init__).parameters)
    return {k: v for k, v in config.items() if k in names}


def _build_denoiser(part: str, config: dict) -> torch.nn.Module:
    import diffusers
    default = "UNet2DConditionModel" if part == "unet" else ""
    name = str(config.get("_class_name") or default)
    known = {info.denoiser_class for info in FAMILIES.values()}
    if name not in known:
        raise EstimateError(f"{part}/config.json names {name!r}; the estimate knows {', '.join(sorted(known))}.")
    cls = getattr(diffusers, name)
    with torch.device("meta"):
        return cls(**_known_args(cls, config))


def _build_vae(config: dict) -> torch.nn.Module:
    import diffusers
    # The families' own VAE classes (Flux.2's AutoencoderKLFlux2, ...) by the name their config records.
    cls = getattr(diffusers, str(config.get("_class_name", "AutoencoderKL")), diffusers.AutoencoderKL)
    with torch.device("meta"):
        return cls(**_known_args(cls, config))


def _build_text_encoder(config: dict, with_projection: bool) -> torch.nn.Module:
    import transformers
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    fields = {k: v for k, v in config.items() if not k.startswith("_") and k != "architectures"}
    architecture = next(iter(config.get("architectures") or ()), "")
    if architecture and not architecture.startswith("CLIP"):
        # T5 and the language models of the newer families (Mistral, Qwen): the class the config names.
        cls = getattr(transformers, architecture)
        with torch.device("meta"):
            return cls(cls.config_class(**fields))
    if architecture == "CLIPTextModelWithProjection":
        with_projection = True
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    with torch.device("meta"):
        return cls(CLIPTextConfig(**fields))


def build_meta_model(part: str, config: dict) -> torch.nn.Module:
    """A shape-only module of one component (no memory is allocated)."""
    if part in ("unet", "transformer"):
        return _build_denoiser(part, config)
    if part == "vae":
        return _build_vae(config)
    return _build_text_encoder(config, with_projection=part == "text_encoder_2")


def component_of(model: torch.nn.Module) -> Component:
    return Component(type(model).__name__, {name: tuple(p.shape) for name, p in model.named_parameters()})


def measure(configs: dict[str, dict]) -> dict[str, Component]:
    """Each component built on `meta` and described by its parameters (`model_sizes.Measure`)."""
    return {part: component_of(build_meta_model(part, config)) for part, config in configs.items()}


def builtin_folder(family: str) -> Path:
    """A built-in model's folder, built on first use."""
    from modules.model.families import family as family_of
    return Path(family_of(family).build_demo())


def sizes(cfg) -> ModelSizes:
    """The sizes of `cfg.model`'s model, by the fastest way that works; `EstimateError` naming the field
    when it cannot be sized."""
    try:
        return model_sizes(cfg, measure, builtin_folder)
    except SizesUnavailable as e:
        path = Path(cfg.model.base_model.strip()).expanduser()
        if cfg.model.model_type == "auto" and path.suffix == ".safetensors" and path.is_file():
            _family_by_the_model_layer(path)  # its error names what the file is (an SDXL refiner, ...)
        raise EstimateError(str(e)) from None
    except (OSError, ValueError) as e:
        raise EstimateError(str(e)) from None


def _family_by_the_model_layer(path: Path) -> str:
    from safetensors import safe_open

    from modules.model.families import detect_checkpoint
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    try:
        return detect_checkpoint(keys, source=path)
    except ValueError as e:
        raise EstimateError(str(e)) from None


def estimate(cfg, setup: Setup | None = None, model: ModelSizes | None = None) -> dict:
    """Per-GPU memory in GiB for training `cfg` as `setup` (default: as configured, one GPU or DDP - every GPU
    holds the whole model), by part, with the sizes it came from: what `check_multi_gpu.py` prints."""
    model = model or sizes(cfg)
    f = facts(model, cfg)
    t = cfg.training
    setup = setup or Setup("ddp" if cfg.multi_gpu.enabled else "single", 1, cfg.model.unet_dtype == "fp8",
                           t.gradient_checkpointing)
    result = need(f, cfg, setup)
    per_sample = memory_need.activation_bytes_per_sample(f, cfg, setup)
    return {"model_type": model.family, "architecture_source": model.source, "params": f.params,
            "method": t.method, "optimizer": cfg.optimizer.name, "batch_size": t.batch_size,
            "resolution": cfg.data.resolution, "precision": t.precision, "gradient_checkpointing": t.gradient_checkpointing,
            "parts": result.parts, "training": result.training, "caching": result.caching, "total": result.total,
            "activations_per_sample": None if per_sample is None else per_sample / GIB,
            "activations_known": result.activations_known}


PARTS_BY_PREFIX = ("text_encoder_3", "text_encoder_2", "text_encoder", "transformer", "unet", "vae")


def write_shipped_sizes(folder: Path = SHIPPED_SIZES_DIR) -> list[Path]:
    """The published sizes of every component config Tandem ships, variants (`transformer_large.json`)
    included: each built on `meta` once, here."""
    import json

    written = []
    for path in sorted(CONFIGS_DIR.glob("*/*.json")):
        part = next((p for p in PARTS_BY_PREFIX if path.stem.startswith(p)), None)
        if part is None or path.parent == folder or not counted_parts(path.parent.name, [part]):
            continue  # a scheduler's config, or a text encoder loaded apart (never beside the model)
        config = json.loads(path.read_text(encoding="utf-8"))
        written.append(store_component(config, component_of(build_meta_model(part, config)), folder))
    return [p for p in written if p is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the published sizes of the configs in modules/model/configs/.")
    parser.add_argument("--write-shipped", action="store_true", help=f"(re)write {SHIPPED_SIZES_DIR}")
    args = parser.parse_args(argv)
    if args.write_shipped:
        for stale in SHIPPED_SIZES_DIR.glob("*.json"):
            stale.unlink()
        for path in write_shipped_sizes():
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
