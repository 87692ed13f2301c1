"""Optimizer and learning-rate schedule from the config."""
from __future__ import annotations

import math

import torch

from modules.config import OptimizerConfig, TrainingConfig
from modules.util.layout import in_layout_of


def build_optimizer(param_groups: list[dict], cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    name = cfg.name
    if name == "adamw":
        kwargs = dict(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
        if cfg.fused and device.type == "cuda":
            kwargs["fused"] = True
        return torch.optim.AdamW(param_groups, **kwargs)
    if name == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise RuntimeError("optimizer.name: adamw_8bit needs the bitsandbytes package "
                               "(pip install bitsandbytes), or choose adamw.") from None
        return bnb.optim.AdamW8bit(param_groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                   weight_decay=cfg.weight_decay)
    if name == "adafactor":
        return torch.optim.Adafactor(param_groups, weight_decay=cfg.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(param_groups, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    raise ValueError(f"optimizer.name: unknown optimizer {name!r}; use adamw, adamw_8bit, adafactor or sgd")


def match_param_layouts(optimizer: torch.optim.Optimizer) -> None:
    """Give every per-parameter state tensor of the parameter's shape (Adam's moments) the parameter's
    memory layout (strides).

    Loading a state dict keeps the layout the tensors were saved in, so a backup from a run with
    another `training.channels_last` setting brings moments in the other layout. Fused AdamW walks
    parameters, gradients and moments as flat memory and needs them to share strides: on CUDA it
    refuses a mismatch, on CPU it silently pairs the wrong elements.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.stride() != p.stride():
                    state[key] = in_layout_of(p, value)


def lr_lambda(cfg: TrainingConfig, total_steps: int):
    """Multiplier of the base LR at each optimizer step: linear warm-up, then the chosen schedule."""
    warmup = cfg.lr_warmup_steps
    decay_steps = max(1, total_steps - warmup)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / decay_steps)
        if cfg.lr_scheduler == "linear":
            return 1.0 - progress
        if cfg.lr_scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0
    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
