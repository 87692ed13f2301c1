"""Estimate of the GPU memory one rank needs for a `TrainConfig`, before anything is loaded.

Every rank of DistributedDataParallel holds a full copy of the model, its gradients and its
optimizer state, so the per-GPU estimate does not shrink with more GPUs; only the global batch grows.
With FSDP (`estimate_fsdp`) each rank keeps 1/N of the trained module's parameters, gradients,
optimizer state and EMA, plus the blocks being gathered at the moment; `modules/distributed/strategy.py`
compares the two for `multi_gpu.strategy = auto`.

Parameter counts are exact: the networks are built on PyTorch's `meta` device (shapes only, no
memory, no download) from the base model's own diffusers folder, the demo model's folder, or the
real-size configs Tandem ships in `modules/model/configs/<type>/` (the ones the single-file loader
uses); the family is told by the model layer's own rules (`modules.model.families.detect_folder` /
`detect_checkpoint`). Activation memory is the one real estimate: a per-sample coefficient measured
once per model family (see `ACTIVATION_GIB_PER_SAMPLE`), scaled by resolution and precision.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from modules.config.model_families import FAMILIES, guess_family

GIB = 1024 ** 3
MODEL_CONFIGS_DIR = Path(__file__).resolve().parents[1] / "model" / "configs"

# The published parameter counts of the Stable Diffusion architectures Tandem ships configs for
# (modules/model/configs/<type>/); tests build those configs on `meta` and compare.
PUBLISHED_PARAMS_M = {"sd1": {"unet": 859.5, "text_encoder": 123.1},
                      "sd2": {"unet": 865.9, "text_encoder": 340.4},
                      "sdxl": {"unet": 2567.5, "text_encoder": 123.1, "text_encoder_2": 694.7}}

TRANSFORMER_CLASSES = {name: info.denoiser_class for name, info in FAMILIES.items() if info.denoiser == "transformer"}
"""The diffusers class of each transformer family's denoiser (built on `meta` from its config)."""

# GiB of activations per sample at `ACTIVATION_REFERENCE_RESOLUTION`, bf16 autocast, PyTorch SDPA
# attention, (without, with) gradient checkpointing. Measured on an H200 (torch 2.11+cu130, diffusers
# 0.42.1, randomly initialised fp32 UNet, full backward) as the growth of peak allocated memory from
# batch 1 to batch 3, divided by 2; the raw numbers are in docs/MultiGPUTraining.md. Scaled
# linearly with pixel count (SDPA attention memory grows linearly with tokens) and x2 for fp32.
# An estimate: kernels and allocator behaviour differ between GPUs and versions.
ACTIVATION_REFERENCE_RESOLUTION = {"sd1": 512, "sd2": 768, "sdxl": 1024}
ACTIVATION_GIB_PER_SAMPLE = {"sd1": (1.17, 0.22), "sd2": (2.63, 0.48), "sdxl": (8.28, 0.65)}
# The same measurement's batch-independent part matched autocast's cache of bf16 copies of the
# fp32 UNet weights (2 bytes x parameters: 1.60 GiB predicted vs 1.71 measured for sd1, 4.78 vs
# 4.73 for sdxl), so that cache is counted from the parameter count instead of a constant.
# CUDA context, cuBLAS/cuDNN workspaces and allocator slack of a training process.
RUNTIME_OVERHEAD_GIB = 1.0

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# LoRA targets for CLIP text encoders when `train_text_encoder` is on: their attention projections.
TEXT_ENCODER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


class EstimateError(ValueError):
    """The config names something the estimate cannot size (unknown model type, unreadable folder)."""


def _build_unet(config: dict) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel
    with torch.device("meta"):
        return UNet2DConditionModel(**_known_args(UNet2DConditionModel, config))


def _build_vae(config: dict) -> torch.nn.Module:
    import diffusers
    # The families' own VAE classes (Flux.2's AutoencoderKLFlux2, ...) by the name their config records.
    cls = getattr(diffusers, str(config.get("_class_name", "AutoencoderKL")), diffusers.AutoencoderKL)
    with torch.device("meta"):
        return cls(**_known_args(cls, config))


def _build_transformer(class_name: str, config: dict) -> torch.nn.Module:
    import diffusers
    cls = getattr(diffusers, class_name)
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


def _never_trains(model: torch.nn.Module) -> bool:
    """Whether a text encoder never trains: only CLIP encoders do (T5 and language models stay frozen)."""
    return not type(model).__name__.startswith("CLIP")


def _known_args(cls, config: dict) -> dict:
    """The entries of a diffusers `config.json` that the class accepts (drops `_class_name` etc.)."""
    import inspect
    names = set(inspect.signature(cls.__init__).parameters)
    return {k: v for k, v in config.items() if k in names}


COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")


def _read_folder(folder: Path) -> dict:
    """Component configs of a diffusers model folder: `{"unet": {...}, "text_encoder": {...}, ...}`."""
    found = {}
    for part in COMPONENTS:
        path = folder / part / "config.json"
        if path.is_file():
            found[part] = json.loads(path.read_text(encoding="utf-8"))
    if "unet" not in found and "transformer" not in found:
        raise EstimateError(f"{folder} has no unet/config.json or transformer/config.json; model.base_model must "
                            "be a diffusers folder, a single .safetensors/.ckpt file or a builtin: model.")
    return found


def _demo_folder() -> Path:
    try:
        from modules.model.demo import ensure_demo_model
    except ImportError as e:
        raise EstimateError("model.base_model is builtin:demo but modules.model.demo.ensure_demo_model is not "
                            f"available ({e}); the memory estimate cannot size the demo model.") from None
    return Path(ensure_demo_model())


def _detect_single_file_type(path: Path) -> str:
    """The family of a single-file checkpoint, by the model layer's rules (header only for .safetensors)."""
    if path.suffix != ".safetensors":
        raise EstimateError(f"model.model_type is auto and {path} is not .safetensors; set model.model_type "
                            "to sd1, sd2 or sdxl for the estimate.")
    from safetensors import safe_open

    from modules.model.families import detect_checkpoint
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    try:
        return detect_checkpoint(keys, source=path)
    except ValueError as e:
        raise EstimateError(str(e)) from None


def _detect_folder_type(folder: Path) -> str:
    """The family of a diffusers folder, by the model layer's rules."""
    from modules.model.families import detect_folder
    try:
        return detect_folder(folder)[0]
    except (OSError, ValueError) as e:
        raise EstimateError(str(e)) from None


def shipped_components(model_type: str) -> dict:
    """The real-size component configs Tandem ships for `model_type` (modules/model/configs/<type>/)."""
    from modules.model.single_file import shipped_config
    return {part: shipped_config(model_type, part) for part in COMPONENTS
            if (MODEL_CONFIGS_DIR / model_type / f"{part}.json").is_file()}


def resolve_architecture(cfg) -> tuple[str, str, dict]:
    """(model family, where the shapes came from, component configs) for `cfg.model`."""
    base, model_type = cfg.model.base_model, cfg.model.model_type
    family = guess_family(base, model_type)
    if family in TRANSFORMER_CLASSES:
        return _transformer_architecture(family, base)
    if base == "builtin:demo":
        local = MODEL_CONFIGS_DIR / "demo"
        folder = local if (local / "unet" / "config.json").is_file() else _demo_folder()
        return "sd1", f"demo model ({folder})", _read_folder(folder)
    path = Path(base)
    if path.is_dir():
        components = _read_folder(path)
        family = model_type if model_type != "auto" else _detect_folder_type(path)
        return family, f"diffusers folder {path}", components
    if model_type == "auto":
        if not path.is_file():
            raise EstimateError(f"model.base_model: {base!r} does not exist and model.model_type is auto; "
                                "fix the path or set model.model_type to sd1, sd2 or sdxl.")
        model_type = _detect_single_file_type(path)
    if model_type not in ACTIVATION_GIB_PER_SAMPLE:
        raise EstimateError(f"model.model_type: {model_type!r} is not one of sd1, sd2, sdxl.")
    return model_type, f"shipped configs {MODEL_CONFIGS_DIR / model_type}", shipped_components(model_type)


def _transformer_architecture(family: str, base: str) -> tuple[str, str, dict]:
    """The transformer families: the folder's own configs, the built-in model's, or the real-size ones Tandem
    ships. A text encoder loaded apart (Qwen-Image, Z-Image) is freed before training: it is left out."""
    if base == FAMILIES[family].demo:
        from modules.model.families import family as family_of
        folder = Path(family_of(family).build_demo())
        found = (family, f"built-in model ({folder})", _read_folder(folder))
    elif Path(base).is_dir():
        found = (family, f"diffusers folder {base}", _read_folder(Path(base)))
    else:
        found = (family, f"shipped configs {MODEL_CONFIGS_DIR / family} (the published {FAMILIES[family].title} "
                 "sizes)", shipped_components(family))
    if FAMILIES[family].text_apart:
        found[2].pop("text_encoder", None)
    return found


def build_meta_models(components: dict) -> dict[str, torch.nn.Module]:
    """Shape-only modules for each component config (no memory is allocated)."""
    if "unet" in components:
        models = {"unet": _build_unet(components["unet"])}
    else:
        class_name = components["transformer"].get("_class_name")
        if class_name not in TRANSFORMER_CLASSES.values():
            raise EstimateError(f"transformer/config.json names {class_name!r}; the estimate knows "
                                f"{', '.join(TRANSFORMER_CLASSES.values())}.")
        models = {"transformer": _build_transformer(class_name, components["transformer"])}
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if name in components:
            models[name] = _build_text_encoder(components[name], with_projection=name == "text_encoder_2")
    if "vae" in components:
        models["vae"] = _build_vae(components["vae"])
    return models


def _is_target(name: str, targets) -> bool:
    # peft's rule for a list of names: the module's full name equals a target or ends in ".target".
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_shapes(model: torch.nn.Module, targets, rank: int) -> list[tuple[int, ...]]:
    """Shapes of the LoRA A/B matrices peft would add to `model` for these targets and rank."""
    shapes = []
    for name, module in model.named_modules():
        if not _is_target(name, targets):
            continue
        if isinstance(module, torch.nn.Linear):
            shapes += [(rank, module.in_features), (module.out_features, rank)]
        elif isinstance(module, torch.nn.Conv2d):
            kh, kw = module.kernel_size
            shapes += [(rank, module.in_channels, kh, kw), (module.out_channels, rank, 1, 1)]
    return shapes


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def optimizer_state_bytes(name: str, shapes: list[tuple[int, ...]], momentum: float, prodigy_slice_p: int = 1) -> int:
    """Bytes of optimizer state for trainable tensors of these shapes."""
    params = sum(_numel(s) for s in shapes)
    if name == "adamw":
        return 8 * params  # exp_avg + exp_avg_sq in fp32
    if name == "adamw_schedule_free":
        return 8 * params  # z + exp_avg_sq (samples and saves copy the weights once more while they run)
    if name == "prodigy":
        # exp_avg + exp_avg_sq, and every p-th element of each tensor twice (its start value p0 and s)
        return 8 * params + 8 * sum(-(-_numel(s) // prodigy_slice_p) for s in shapes)
    if name == "adamw_8bit":
        return 2 * params  # bitsandbytes: two 8-bit states (block-wise scales are negligible)
    if name == "sgd":
        return 4 * params if momentum > 0 else 0
    if name == "adafactor":
        # Factored second moment (row + column vectors) for matrices, full for vectors; no first moment.
        total = 0
        for s in shapes:
            if len(s) >= 2:
                total += 4 * (_numel(s[:-1]) + _numel(s[:-2]) * s[-1])
            else:
                total += 4 * _numel(s)
        return total
    raise EstimateError(f"optimizer.name: {name!r} is not one of adamw, adamw_8bit, adafactor, sgd, prodigy, "
                        "adamw_schedule_free.")


def frozen_unet_bytes(unet: torch.nn.Module, unet_dtype: str) -> int:
    """Bytes of a frozen (LoRA base) UNet stored as `model.unet_dtype` says; fp8 stores the weights of Linear
    layers in 1 byte (plus one scale each) and the rest in bf16 (modules/model/float8.py)."""
    params = sum(p.numel() for p in unet.parameters())
    if unet_dtype != "fp8":
        return params * DTYPE_BYTES[unet_dtype]
    linear = [m.weight.numel() for m in unet.modules() if isinstance(m, torch.nn.Linear)]
    return sum(linear) + 4 * len(linear) + 2 * (params - sum(linear))


def _activation_gib_per_sample(family: str, resolution: int, precision: str, checkpointing: bool) -> float | None:
    """None for a family whose activations have not been measured (SD3, Flux)."""
    if family not in ACTIVATION_GIB_PER_SAMPLE:
        return None
    without, with_ckpt = ACTIVATION_GIB_PER_SAMPLE[family]
    scale = (resolution / ACTIVATION_REFERENCE_RESOLUTION[family]) ** 2
    return (with_ckpt if checkpointing else without) * scale * (2.0 if precision == "fp32" else 1.0)


def _unit_sizes(family: str, denoiser: torch.nn.Module, encoders: list[torch.nn.Module]) -> tuple[int, int]:
    """(largest FSDP unit, parameters outside every unit) of the trained modules: the family's repeated
    blocks and the text encoders' layers are the units, as `fsdp.shard` makes them."""
    from types import SimpleNamespace

    from modules.model.families import family as family_of

    fam = family_of(family)
    blocks = fam.repeated_blocks(SimpleNamespace(unet=denoiser, denoiser=denoiser))
    for encoder in encoders:
        blocks += fam.text_encoder_blocks(encoder)
    sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    total = sum(p.numel() for m in [denoiser, *encoders] for p in m.parameters())
    return max(sizes, default=0), total - sum(sizes)


def estimate(cfg) -> dict:
    """Per-GPU memory in GiB for training `cfg` with DDP: weights, gradients, optimizer state, EMA, activations.

    Raises `EstimateError` naming the config field when the model cannot be sized. Activations are None
    (and left out of the total) for a family whose activation memory has not been measured.
    """
    family, source, components = resolve_architecture(cfg)
    models = build_meta_models(components)
    t, m = cfg.training, cfg.model
    lora = t.method == "lora"
    counts = {name: sum(p.numel() for p in mod.parameters()) for name, mod in models.items()}
    denoiser = "unet" if "unet" in models else "transformer"
    what = "UNet" if denoiser == "unet" else "transformer"

    trainable: list[tuple[int, ...]] = []
    if lora:
        trainable += lora_shapes(models[denoiser], t.lora_target_modules, t.lora_rank)
        if not trainable:
            raise EstimateError(f"training.lora_target_modules: {t.lora_target_modules} match no module of "
                                f"the {what}; use names like to_q, to_k, to_v, to_out.0.")
    else:
        trainable += [tuple(p.shape) for p in models[denoiser].parameters()]
    encoders = [n for n in ("text_encoder", "text_encoder_2", "text_encoder_3") if n in models]
    trained_encoders = [n for n in encoders if not _never_trains(models[n])] if t.train_text_encoder else []  # T5 never trains
    for name in trained_encoders:
        trainable += (lora_shapes(models[name], TEXT_ENCODER_LORA_TARGETS, t.lora_rank) if lora
                      else [tuple(p.shape) for p in models[name].parameters()])
    trainable_params = sum(_numel(s) for s in trainable)

    # Trained weights are kept in fp32 (master weights); frozen ones in their configured dtype.
    weight_bytes = frozen_unet_bytes(models[denoiser], m.unet_dtype) if lora else 0
    weight_bytes += trainable_params * 4
    frozen_encoders = [n for n in encoders if lora or n not in trained_encoders]
    frozen_encoder_bytes = sum(counts[n] for n in frozen_encoders) * DTYPE_BYTES[m.text_encoder_dtype]
    weight_bytes += frozen_encoder_bytes + counts.get("vae", 0) * DTYPE_BYTES[m.vae_dtype]

    gradient_bytes = trainable_params * 4
    ddp_bucket_bytes = gradient_bytes if cfg.multi_gpu.enabled and not cfg.multi_gpu.gradient_as_bucket_view else 0
    optimizer_bytes = optimizer_state_bytes(cfg.optimizer.name, trainable, cfg.optimizer.momentum,
                                            cfg.optimizer.prodigy_slice_p)
    ema_bytes = trainable_params * 4 if t.ema else 0
    # Autocast keeps a half-precision copy of every fp32 UNet weight it uses during the forward.
    fp32_denoiser = counts[denoiser] if (not lora or m.unet_dtype == "fp32") else 0
    autocast_bytes = 2 * fp32_denoiser if t.precision in ("bf16", "fp16") else 0

    per_sample = {ck: _activation_gib_per_sample(family, cfg.data.resolution, t.precision, ck)
                  for ck in (False, True)}
    measured = per_sample[False] is not None
    activations = per_sample[t.gradient_checkpointing] * t.batch_size if measured else None
    fixed = (weight_bytes + gradient_bytes + ddp_bucket_bytes + optimizer_bytes + ema_bytes + autocast_bytes) / GIB \
        + RUNTIME_OVERHEAD_GIB
    largest_unit, outside_units = _unit_sizes(family, models[denoiser], [models[n] for n in trained_encoders])
    note = ("Weights, gradients and optimizer state are exact for the shapes; activations use a per-sample "
            "coefficient measured on an H200 and are an estimate." if measured else
            f"Weights, gradients and optimizer state are exact for the shapes; the activation memory of "
            f"{FAMILIES[family].title} has not been measured, so it is NOT included: leave room for it (a few "
            "GiB per image at 1024 px with gradient checkpointing).")
    return {
        "model_type": family,
        "architecture_source": source,
        "params": {**counts, "trainable": trainable_params},
        "method": t.method,
        "optimizer": cfg.optimizer.name,
        "batch_size": t.batch_size,
        "resolution": cfg.data.resolution,
        "precision": t.precision,
        "gradient_checkpointing": t.gradient_checkpointing,
        "weights": weight_bytes / GIB,
        "gradients": gradient_bytes / GIB,
        "ddp_buckets": ddp_bucket_bytes / GIB,
        "optimizer_state": optimizer_bytes / GIB,
        "ema": ema_bytes / GIB,
        "autocast_cache": autocast_bytes / GIB,
        "activations": activations,
        "activations_measured": measured,
        "runtime_overhead": RUNTIME_OVERHEAD_GIB,
        "total": fixed + (activations or 0.0),
        "fixed": fixed,
        "activations_per_sample": per_sample[False],
        "activations_per_sample_checkpointed": per_sample[True],
        # What FSDP shards (the trained module: the denoiser and the text encoders that train) and
        # what it does not (the VAE and frozen text encoders), for estimate_fsdp.
        "replicated_weights": (sum(counts[n] for n in encoders if n not in trained_encoders)
                               * DTYPE_BYTES[m.text_encoder_dtype] + counts.get("vae", 0) * DTYPE_BYTES[m.vae_dtype]) / GIB,
        "largest_unit_params": largest_unit,
        "params_outside_units": outside_units,
        "note": note,
    }


def estimate_fsdp(est: dict, world_size: int, cpu_offload: bool = False) -> dict:
    """Per-GPU memory in GiB for the same training with FSDP over `world_size` GPUs, from `estimate`'s result.

    Sharded 1/N: the trained module's weights (frozen LoRA base included), gradients, optimizer state and
    EMA - or none of them on the GPU with `cpu_offload` (then they take host memory, `host_offload`).
    Whole on every GPU: the VAE and the frozen text encoders, the parameters outside the blocks (the root
    unit, kept gathered from forward to backward), two gathered blocks (the running one and the next,
    prefetched) with the gradients of one, activations and the runtime overhead. No autocast copies:
    with bf16 the gathered weights are bf16 already.
    """
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    compute_bytes = 2 if est["precision"] == "bf16" else 4
    sharded = est["weights"] - est["replicated_weights"] + est["gradients"] + est["optimizer_state"] + est["ema"]
    unit = est["largest_unit_params"] * compute_bytes / GIB
    gathered = 2 * unit + unit + est["params_outside_units"] * compute_bytes / GIB
    on_gpu_sharded = 0.0 if cpu_offload else sharded / world_size
    fixed = on_gpu_sharded + est["replicated_weights"] + gathered + est["runtime_overhead"]
    return {
        "strategy": "fsdp", "world_size": world_size, "cpu_offload": cpu_offload,
        "sharded": on_gpu_sharded, "host_offload": sharded / world_size if cpu_offload else 0.0,
        "replicated_weights": est["replicated_weights"], "gathered_blocks": gathered,
        "activations": est["activations"], "runtime_overhead": est["runtime_overhead"],
        "fixed": fixed, "total": fixed + (est["activations"] or 0.0),
    }


def largest_batch_that_fits(est: dict, free_gib: float, checkpointing: bool) -> int | None:
    """Largest per-GPU batch size whose estimate stays within `free_gib` (0 when none fits; None when the
    family's activation memory is unknown)."""
    per_sample = est["activations_per_sample_checkpointed" if checkpointing else "activations_per_sample"]
    if per_sample is None:
        return None
    room = free_gib - est["fixed"]
    if room <= 0 or per_sample <= 0:
        return 0
    return int(room // per_sample)
