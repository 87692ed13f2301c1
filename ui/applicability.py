"""Which fields the current config does not use, and why (the views grey those out).

A field that does nothing in this config (LoRA rank in a full fine-tune, SGD momentum for AdamW) is
disabled rather than hidden, so the form keeps its shape; its tooltip says what would make it count.
Only fields whose value is ignored are listed: nothing here changes what training does.
"""
from __future__ import annotations

from typing import Callable

from modules.config import TrainConfig
from modules.families.registry import FAMILIES, guess_family

Rule = Callable[[TrainConfig], "str | None"]

_ADAM = ("adamw", "adamw_8bit", "prodigy", "adamw_schedule_free")
"""The optimizers that take Adam's betas and epsilon."""


def _lora(c: TrainConfig) -> str | None:
    return None if c.training.method == "lora" else "used only by LoRA training (Method is full)"


def _full(c: TrainConfig) -> str | None:
    return None if c.training.method == "full" else "used only by full fine-tuning (Method is lora)"


def _adam(c: TrainConfig) -> str | None:
    return None if c.optimizer.name in _ADAM else \
        f"used only by AdamW, 8-bit AdamW, Prodigy and schedule-free AdamW (Optimizer is {c.optimizer.name})"


def _prodigy(c: TrainConfig) -> str | None:
    return None if c.optimizer.name == "prodigy" else f"used only by Prodigy (Optimizer is {c.optimizer.name})"


def _schedule_free(c: TrainConfig) -> str | None:
    return None if c.optimizer.name == "adamw_schedule_free" else \
        f"used only by schedule-free AdamW (Optimizer is {c.optimizer.name})"


def _schedule(c: TrainConfig, schedule: str, title: str) -> str | None:
    return None if c.training.lr_scheduler == schedule else \
        f"used only by the {title} schedule (LR scheduler is {c.training.lr_scheduler})"


def _multi_gpu(c: TrainConfig) -> str | None:
    return None if c.multi_gpu.enabled else "used only with Multi-GPU on"


def _ddp(c: TrainConfig) -> str | None:
    """DDP's own settings: unused when the run shards with FSDP (with `auto` either may run)."""
    if not c.multi_gpu.enabled:
        return "used only with Multi-GPU on"
    return "used only by DDP (Strategy is fsdp)" if c.multi_gpu.strategy == "fsdp" else None


def _fsdp(c: TrainConfig) -> str | None:
    if not c.multi_gpu.enabled:
        return "used only with Multi-GPU on"
    return "used only by FSDP (Strategy is ddp)" if c.multi_gpu.strategy == "ddp" else None


RULES: dict[str, Rule] = {
    "training.lora_rank": _lora,
    "training.lora_alpha": _lora,
    "training.lora_dropout": _lora,
    "training.lora_target_modules": _lora,
    "training.lora_type": _lora,
    "training.lora_init": _lora,
    "training.lokr_factor": lambda c: _lora(c) or (None if c.training.lora_type == "lokr" else
                                                   f"used only by LoKr (LoRA type is {c.training.lora_type})"),
    "save.lora_format": _lora,
    "save.full_format": _full,
    "optimizer.beta1": _adam,
    "optimizer.beta2": _adam,
    "optimizer.eps": _adam,
    "optimizer.fused": lambda c: None if c.optimizer.name == "adamw" else
    f"used only by AdamW (Optimizer is {c.optimizer.name})",
    "optimizer.momentum": lambda c: None if c.optimizer.name == "sgd" else
    f"used only by SGD (Optimizer is {c.optimizer.name})",
    "optimizer.prodigy_d_coef": _prodigy,
    "optimizer.prodigy_d0": _prodigy,
    "optimizer.prodigy_growth_rate": _prodigy,
    "optimizer.prodigy_use_bias_correction": _prodigy,
    "optimizer.prodigy_safeguard_warmup": _prodigy,
    "optimizer.prodigy_slice_p": _prodigy,
    "optimizer.schedule_free_r": _schedule_free,
    "optimizer.schedule_free_weight_lr_power": _schedule_free,
    "training.text_encoder_learning_rate": lambda c: None if c.training.train_text_encoder else
    "used only when the text encoder is trained (Train text encoder is off)",
    "training.epochs": lambda c: None if c.training.max_steps <= 0 else
    f"not used while Max steps is set ({c.training.max_steps} steps decide the length)",
    "training.lr_cycles": lambda c: _schedule(c, "cosine_with_restarts", "cosine with restarts"),
    "training.lr_power": lambda c: _schedule(c, "polynomial", "polynomial"),
    "training.lr_decay_fraction": lambda c: _schedule(c, "warmup_stable_decay", "warmup-stable-decay"),
    "training.ema_decay": lambda c: None if c.training.ema else "used only with EMA of weights on",
    "save.ema_weights": lambda c: None if c.training.ema else "used only with EMA of weights on",
    "data.keep_tags": lambda c: None if c.data.shuffle_tags else "used only with Shuffle tags on",
    "data.tag_separator": lambda c: None if c.data.shuffle_tags or c.data.caption_prefix or c.data.caption_suffix
    else "used only with Shuffle tags on or a caption prefix or suffix",
    "data.bucket_step": lambda c: None if c.data.aspect_bucketing else "used only with Aspect-ratio buckets on",
    "data.min_bucket_size": lambda c: None if c.data.aspect_bucketing else "used only with Aspect-ratio buckets on",
    "data.max_bucket_size": lambda c: None if c.data.aspect_bucketing else "used only with Aspect-ratio buckets on",
    "data.cache_text_embeddings": lambda c: None if not (c.training.train_text_encoder or c.data.shuffle_tags)
    else "not possible while the text encoder trains or tags are shuffled (captions change every time)",
    "training.validation_every_n_steps": lambda c: None if c.data.validation_fraction > 0 or any(
        concept.enabled and concept.role == "validation" for concept in c.data.concepts) else
    "used only with a validation set (a concept with Role validation, or Hold out for validation above 0)",
    "data.prefetch_factor": lambda c: None if c.data.num_workers > 0 else "used only with Loader workers above 0",
    "multi_gpu.strategy": _multi_gpu,
    "multi_gpu.launcher": _multi_gpu,
    "multi_gpu.batch_split": _multi_gpu,
    "multi_gpu.fsdp_cpu_offload": _fsdp,
    "multi_gpu.activation_offload": lambda c: None if c.training.gradient_checkpointing else
    "used only with Gradient checkpointing on (it moves what checkpointed blocks keep)",  # one GPU too
    "multi_gpu.memory_limit_gib": _multi_gpu,
    "multi_gpu.layer_offload": _lora,  # one GPU too: block swap of a LoRA's frozen base
    "multi_gpu.context_parallel": lambda c: _multi_gpu(c) or (
        None if FAMILIES.get(c.model.model_type) is None or FAMILIES[c.model.model_type].context_parallel
        else f"{FAMILIES[c.model.model_type].title} cannot split a sample over GPUs (Wan can)"),
    "multi_gpu.backend": _multi_gpu,
    "multi_gpu.distributed_data_loading": _multi_gpu,
    "multi_gpu.lr_scaling": _multi_gpu,
    "multi_gpu.master_port": _multi_gpu,
    "multi_gpu.master_addr": _multi_gpu,
    "multi_gpu.stall_seconds": _multi_gpu,
    "multi_gpu.timeout_minutes": _multi_gpu,
    "multi_gpu.bucket_cap_mb": _ddp,
    "multi_gpu.gradient_compression": _ddp,
    "multi_gpu.static_graph": _ddp,
    "multi_gpu.find_unused_parameters": _ddp,
    "multi_gpu.gradient_as_bucket_view": _ddp,
    "multi_gpu.max_restarts": lambda c: _multi_gpu(c) or (None if c.multi_gpu.launcher != "spawn"
                                                           else "needs the torchrun launcher (or auto)"),
    "multi_gpu.nnodes": lambda c: _multi_gpu(c) or (None if c.multi_gpu.launcher != "spawn"
                                                     else "needs the torchrun launcher (or auto)"),
    "multi_gpu.node_rank": lambda c: _multi_gpu(c) or (None if c.multi_gpu.nnodes > 1 else "used only with several machines"),
    "multi_gpu.min_gpus": lambda c: _multi_gpu(c) or (None if c.multi_gpu.nnodes > 1 and c.multi_gpu.max_restarts > 0
                                                       else "used only with several machines and restarts on"),
}


def takes_controls(cfg: TrainConfig) -> bool:
    """Whether control images mean something to the config's model (the concept rows show their column then)."""
    return _controls(cfg) is None


def _controls(cfg: TrainConfig) -> str | None:
    """Control images mean something to edit models only; while the family is not known, they may."""
    family = guess_family(cfg.model.base_model, cfg.model.model_type)
    if family is None or FAMILIES[family].controls:
        return None
    edit = ", ".join(info.title for info in FAMILIES.values() if info.controls)
    return f"used only by edit models ({edit}); this model is {FAMILIES[family].title}"


def unused_fields(cfg: TrainConfig) -> dict[str, str]:
    """Field path -> why it does nothing in `cfg`, for every field the config does not use (list items too:
    `data.concepts[0].control`)."""
    reasons = {}
    for path, rule in RULES.items():
        reason = rule(cfg)
        if reason:
            reasons[path] = reason
    controls = _controls(cfg)
    if controls:
        reasons.update({f"data.concepts[{i}].control": controls for i in range(len(cfg.data.concepts))})
        reasons.update({f"sampling.prompts[{i}].control": controls for i in range(len(cfg.sampling.prompts))})
    return reasons
