"""What a saved LoRA file says about itself: SAI ModelSpec (`modelspec.*`) and kohya's `ss_*` keys.

Key names and value spellings are those kohya sd-scripts writes (`library/sai_model_spec.py`,
`train_network.py`): every value a string, booleans `True`/`False`, `ss_resolution` `(512, 512)`,
`modelspec.resolution` `512x512`, `modelspec.date` ISO-8601. A1111/Forge's LoRA cards, ComfyUI and
model sites read these. No absolute local path is ever written: the base model, VAE and image folders
appear by their file or folder name only (a path would give away the user's folders to whoever gets
the file).
"""
from __future__ import annotations

import datetime
import math
from collections import Counter
from pathlib import Path
from typing import Any

MODELSPEC_VERSION = "1.0.1"
IMPLEMENTATION_SGM = "https://github.com/Stability-AI/generative-models"
IMPLEMENTATION_FLUX = "https://github.com/black-forest-labs/flux"
IMPLEMENTATION_FLUX2 = "https://github.com/black-forest-labs/flux2"
IMPLEMENTATION_CHROMA = "https://huggingface.co/lodestones/Chroma"
IMPLEMENTATION_DIFFUSERS = "diffusers"


def display_name(source: str) -> str:
    """A model or folder reference without its location: `builtin:demo` stays, a path becomes its name."""
    if not source or source.startswith("builtin:"):
        return source
    return Path(source.rstrip("/\\").replace("\\", "/")).name


def file_metadata(bundle, fmt: str, rank: int, alpha: float, title: str, lora_type: str = "lora",
                  now: datetime.datetime | None = None) -> dict[str, str]:
    """The keys every Tandem LoRA file carries: what it is, for which base model, in which layout.

    What depends on the model family (ModelSpec architecture, whose module names the layout uses,
    the usual resolution, kohya's base-model keys) comes from the family (`family.lora_modelspec`,
    `family.kohya_metadata`).
    """
    now = now or datetime.datetime.now()
    header = {
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        **bundle.family.lora_modelspec(bundle, fmt),
        "modelspec.implementation_version": f"tandem/{_tandem_version()}",
        "modelspec.title": title,
        "modelspec.date": now.replace(microsecond=0).isoformat(),
        **_network_module(lora_type),
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(float(alpha)),
        **bundle.family.kohya_metadata(bundle),
        "ss_sd_model_name": display_name(bundle.source),
        "tandem_base_model": display_name(bundle.source),
        "tandem_model_type": bundle.model_type,
        "tandem_lora_format": fmt,
        "tandem_lora_type": lora_type,
    }
    if bundle.prediction_type in ("epsilon", "v_prediction"):
        header["modelspec.prediction_type"] = "v" if bundle.prediction_type == "v_prediction" else "epsilon"
    if getattr(bundle, "vae_source", ""):
        header["ss_vae_name"] = display_name(bundle.vae_source)
    return header


def _network_module(lora_type: str) -> dict[str, str]:
    """kohya's description of the network: sd-scripts' own LoRA module, or LyCORIS's with its algorithm
    (as LyCORIS records LoHa, LoKr and DoRA, `dora_wd`)."""
    if lora_type == "lora":
        return {"ss_network_module": "networks.lora"}
    args = {"algo": "lora", "dora_wd": "True"} if lora_type == "dora" else {"algo": lora_type}
    import json
    return {"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps(args, sort_keys=True)}


def checkpoint_metadata(bundle, title: str, now: datetime.datetime | None = None) -> dict[str, str]:
    """The ModelSpec keys of a full single-file checkpoint (what sd-scripts writes into its saved models): the
    architecture without an adapter suffix, whose names the file uses (the original release's,
    `family.checkpoint_implementation`), title, date, the usual resolution and, for SD, the prediction type."""
    now = now or datetime.datetime.now()
    spec = bundle.family.lora_modelspec(bundle, "kohya")
    header = {
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": spec["modelspec.architecture"].removesuffix("/lora"),
        "modelspec.implementation": bundle.family.checkpoint_implementation(),
        "modelspec.implementation_version": f"tandem/{_tandem_version()}",
        "modelspec.title": title,
        "modelspec.date": now.replace(microsecond=0).isoformat(),
        "modelspec.resolution": spec["modelspec.resolution"],
        "tandem_base_model": display_name(bundle.source),
        "tandem_model_type": bundle.model_type,
    }
    if bundle.prediction_type in ("epsilon", "v_prediction"):
        header["modelspec.prediction_type"] = "v" if bundle.prediction_type == "v_prediction" else "epsilon"
    return header


def training_metadata(cfg, numbers, dataset, step: int, started_at: float,
                      now: datetime.datetime | None = None) -> dict[str, str]:
    """The training settings kohya records (`ss_*`), for a save after optimizer step `step`.

    `numbers` is the run's `RunNumbers`; `dataset` the `TrainDataset` (images, repeats expanded per
    item). Learning rates are the ones the optimizer used (after multi-GPU scaling).
    """
    now = now or datetime.datetime.now()
    t, d = cfg.training, cfg.data
    per_concept_items = Counter(dataset.images[i].concept for i in dataset.item_images)
    per_concept_images = Counter(image.concept for image in dataset.images)
    values: dict[str, Any] = {
        "modelspec.title": cfg.save.output_name,
        "modelspec.resolution": f"{d.resolution}x{d.resolution}",
        "ss_output_name": cfg.save.output_name,
        "ss_training_started_at": started_at,
        "ss_training_finished_at": now.timestamp(),
        "ss_steps": step,
        "ss_epoch": math.ceil(step / numbers.steps_per_epoch),  # the epoch the step belongs to, from 1
        "ss_learning_rate": numbers.lr,
        "ss_unet_lr": numbers.lr,
        "ss_text_encoder_lr": numbers.group_lrs(text_encoders=True)[1] if t.train_text_encoder else None,
        "ss_num_train_images": len(dataset),
        "ss_num_reg_images": 0,
        "ss_num_batches_per_epoch": numbers.micro_batches_per_epoch,
        "ss_num_epochs": numbers.epochs,
        "ss_max_train_steps": numbers.total_steps,
        "ss_batch_size_per_device": numbers.per_gpu_batch,
        "ss_total_batch_size": numbers.global_batch,
        "ss_gradient_accumulation_steps": numbers.accumulation,
        "ss_gradient_checkpointing": t.gradient_checkpointing,
        "ss_lr_warmup_steps": t.lr_warmup_steps,
        "ss_lr_scheduler": t.lr_scheduler,
        "ss_network_dropout": t.lora_dropout,
        "ss_mixed_precision": t.precision,
        "ss_optimizer": cfg.optimizer.name,
        "ss_max_grad_norm": t.max_grad_norm,
        "ss_seed": cfg.general.seed,
        "ss_resolution": f"({d.resolution}, {d.resolution})",
        "ss_enable_bucket": d.aspect_bucketing,
        "ss_flip_aug": d.random_flip,
        "ss_random_crop": d.random_crop,
        "ss_shuffle_caption": d.shuffle_tags,
        "ss_keep_tokens": d.keep_tags,
        "ss_caption_dropout_rate": d.caption_dropout,
        "ss_cache_latents": d.cache_latents,
        "ss_noise_offset": t.offset_noise or None,
        "ss_min_snr_gamma": t.min_snr_gamma or None,
        "ss_clip_skip": t.clip_skip or None,
        "ss_min_bucket_reso": d.min_bucket_size or None,
        "ss_max_bucket_reso": d.max_bucket_size or None,
        "ss_lr_scheduler_num_cycles": t.lr_cycles if t.lr_scheduler == "cosine_with_restarts" else None,
        "ss_lr_scheduler_power": t.lr_power if t.lr_scheduler == "polynomial" else None,
        "tandem_caption_prefix": d.caption_prefix or None,
        "tandem_caption_suffix": d.caption_suffix or None,
        "ss_dataset_dirs": _json({name: {"n_repeats": per_concept_items[name] // count, "img_count": count}
                                  for name, count in per_concept_images.items()}),
        "tandem_world_size": numbers.world_size,
        "tandem_lr_scaling": numbers.lr_scaling,
        "tandem_base_learning_rate": numbers.base_lr,
    }
    return {key: str(value) for key, value in values.items()}


def _json(value) -> str:
    import json
    return json.dumps(value, sort_keys=True)


def _tandem_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown"
