"""Checks of the training-recipe fields that relate to each other: schedules, buckets, captions, clip
skip and the LoRA variants.

Kept beside `validation` (which calls `recipe_problems` from `validate`) so that each file stays short;
every problem is one sentence naming the field, the value and the fix, as there.
"""
from __future__ import annotations

from pathlib import Path

from modules.families.registry import FAMILIES, field_applies
from .train_config import TrainConfig


def recipe_problems(cfg: TrainConfig, family: str | None, check_paths: bool = True) -> list[str]:
    """Every problem of the recipe fields; `family` is the model family the config names, if known."""
    return (_schedule_problems(cfg) + _bucket_problems(cfg) + _clip_skip_problems(cfg, family)
            + _caption_problems(cfg) + _lora_variant_problems(cfg, check_paths))


def _schedule_problems(cfg: TrainConfig) -> list[str]:
    t = cfg.training
    problems = []
    if t.lr_decay_fraction > 1:
        problems.append(f"training.lr_decay_fraction: {t.lr_decay_fraction!r} is more than all the steps; set it "
                        "above 0 and at most 1 (0.2 decays over the last fifth).")
    return problems


def _bucket_problems(cfg: TrainConfig) -> list[str]:
    d = cfg.data
    if not d.aspect_bucketing or d.bucket_step <= 0:
        return []
    problems = []
    for name, value in (("min_bucket_size", d.min_bucket_size), ("max_bucket_size", d.max_bucket_size)):
        if value > 0 and value % d.bucket_step:
            fixed = max(d.bucket_step, round(value / d.bucket_step) * d.bucket_step)
            problems.append(f"data.{name}: {value!r} is not a multiple of data.bucket_step ({d.bucket_step}); "
                            f"set it to {fixed}, for example, or 0 for no bound.")
    if d.min_bucket_size > d.resolution:
        problems.append(f"data.min_bucket_size: {d.min_bucket_size!r} is above data.resolution ({d.resolution}), "
                        "which leaves no bucket; set it to the resolution or less (half of it is usual), or 0.")
    if 0 < d.max_bucket_size < d.resolution:
        problems.append(f"data.max_bucket_size: {d.max_bucket_size!r} is below data.resolution ({d.resolution}), "
                        "which leaves no bucket; set it to the resolution or more (twice it is usual), or 0.")
    return problems


def _clip_skip_problems(cfg: TrainConfig, family: str | None) -> list[str]:
    skip = cfg.training.clip_skip
    if not skip or family is None or family not in FAMILIES:
        return []
    title = FAMILIES[family].title
    if not field_applies("training.clip_skip", family):
        return [f"training.clip_skip: {skip!r} does not apply to {title} (model.model_type {family}), whose "
                "conditioning is not CLIP's alone; set it to 0."]
    if family == "sdxl" and skip < 2:
        return [f"training.clip_skip: {skip!r} would take the last CLIP layer, and {title} conditions on the "
                "penultimate (2, its own choice) or an earlier one; set it to 0 or 2 or more."]
    return []


def _caption_problems(cfg: TrainConfig) -> list[str]:
    d = cfg.data
    if d.tag_separator == "" and (d.shuffle_tags or d.caption_prefix or d.caption_suffix):
        return ['data.tag_separator: "" cannot split a caption into tags; set it to "," (the usual) or another '
                "character that separates the tags."]
    return []


def _lora_variant_problems(cfg: TrainConfig, check_paths: bool) -> list[str]:
    t = cfg.training
    problems = []
    if t.method != "lora":
        if t.lora_init.strip():
            problems.append(f"training.lora_init: {t.lora_init!r} starts LoRA adapters from a file, and "
                            f"training.method is {t.method!r}; set training.method to lora or clear training.lora_init.")
        return problems
    if t.lora_type in ("loha", "lokr") and t.lora_dropout > 0:
        problems.append(f"training.lora_dropout: {t.lora_dropout!r} is LoRA's input dropout, which peft's "
                        f"{t.lora_type} adapters do not have; set it to 0 (or training.lora_type to lora or dora).")
    if t.lora_type == "dora" and cfg.model.unet_dtype == "fp8":
        problems.append("training.lora_type: 'dora' measures the base weights' norms, which model.unet_dtype 'fp8' "
                        "stores in float8; set model.unet_dtype to bf16 (or training.lora_type to lora).")
    if t.lora_type != "lora" and cfg.multi_gpu.enabled and cfg.multi_gpu.strategy == "fsdp":
        problems.append(f"multi_gpu.strategy: 'fsdp' shards the adapters of plain LoRA only, and training.lora_type "
                        f"is {t.lora_type!r}; set multi_gpu.strategy to ddp or auto (a LoRA fits every GPU).")
    if t.lokr_factor == 0 or t.lokr_factor < -1:
        problems.append(f"training.lokr_factor: {t.lokr_factor!r} is not allowed; set it to -1 (as square as "
                        "possible) or a positive number such as 4 or 8.")
    init = t.lora_init.strip()
    if init and check_paths:
        path = Path(init).expanduser()
        if not path.is_file():
            problems.append(f"training.lora_init: {init!r} is not a file; set it to a LoRA .safetensors file or "
                            "leave it empty.")
    if init and not init.lower().endswith(".safetensors"):
        problems.append(f"training.lora_init: {init!r} is not a .safetensors file; LoRA files are read from "
                        ".safetensors only.")
    return problems
