"""Optimizer and learning-rate schedule from the config.

Two optimizers need more than `step()` from the trainer:
- Prodigy (`prodigyopt`) estimates its own step size `d`; the learning rate multiplies it, so the rate
  it trains with is `d x lr` (`effective_lr`).
- Schedule-free AdamW (`schedulefree`) computes gradients at one point (y, which the parameters hold
  while training) and keeps the average it converges to elsewhere (x, "eval mode"). Samples and saved
  models must show x (`evaluation_weights`); backups keep y and the optimizer's state in train mode, so
  that a resumed run continues bit for bit (x follows from y and the optimizer's z).
Both are optional packages, like bitsandbytes for `adamw_8bit`: choosing one without it installed is an
error that names the pip command.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import math

import torch

from modules.config import OptimizerConfig, TrainingConfig
from modules.config.train_config import LR_SCHEDULES
from modules.util.layout import in_layout_of

log = logging.getLogger("tandem")

OPTIONAL_PACKAGES = {"adamw_8bit": ("bitsandbytes", "bitsandbytes"), "prodigy": ("prodigyopt", "prodigyopt"),
                     "adamw_schedule_free": ("schedulefree", "schedulefree")}
"""optimizer.name -> (module to import, pip package) for the optimizers that need a package of their own."""


def optional_module(name: str):
    """The package `optimizer.name` needs, imported; a RuntimeError naming the pip command when missing."""
    module, package = OPTIONAL_PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(f"optimizer.name: {name} needs the {package} package (pip install {package}), "
                           "or choose adamw.") from None


def build_optimizer(param_groups: list[dict], cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    name = cfg.name
    if name == "adamw":
        kwargs = dict(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
        if cfg.fused and device.type in ("cuda", "cpu"):
            kwargs["fused"] = True
        return torch.optim.AdamW(param_groups, **kwargs)
    if name == "adamw_8bit":
        bnb = optional_module(name)
        return bnb.optim.AdamW8bit(param_groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                   weight_decay=cfg.weight_decay)
    if name == "adafactor":
        return torch.optim.Adafactor(param_groups, weight_decay=cfg.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(param_groups, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if name == "prodigy":
        prodigyopt = optional_module(name)
        lr = max(group["lr"] for group in param_groups)
        if lr < 0.1:
            log.warning("optimizer.name prodigy: training.learning_rate is %g, and Prodigy multiplies the step size it "
                        "finds by it; 1.0 is usual (a smaller rate makes every step that much smaller).", lr)
        return prodigyopt.Prodigy(param_groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, decouple=True,
                                  use_bias_correction=cfg.prodigy_use_bias_correction,
                                  safeguard_warmup=cfg.prodigy_safeguard_warmup, d0=cfg.prodigy_d0,
                                  d_coef=cfg.prodigy_d_coef,
                                  growth_rate=cfg.prodigy_growth_rate or float("inf"), slice_p=cfg.prodigy_slice_p)
    if name == "adamw_schedule_free":
        schedulefree = optional_module(name)
        # Warm-up stays with the LR schedule (training.lr_warmup_steps): at optimizer step k both it and the
        # optimizer's own warmup_steps give lr x (k + 1) / warmup, so one setting serves every optimizer.
        optimizer = schedulefree.AdamWScheduleFree(param_groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                                   weight_decay=cfg.weight_decay, warmup_steps=0,
                                                   r=cfg.schedule_free_r,
                                                   weight_lr_power=cfg.schedule_free_weight_lr_power)
        optimizer.train()  # it starts in eval mode and refuses to step there
        return optimizer
    raise ValueError(f"optimizer.name: unknown optimizer {name!r}; use adamw, adamw_8bit, adafactor, sgd, prodigy "
                     "or adamw_schedule_free")


def is_prodigy(optimizer: torch.optim.Optimizer) -> bool:
    return "d_coef" in optimizer.param_groups[0]


def is_schedule_free(optimizer: torch.optim.Optimizer) -> bool:
    return "train_mode" in optimizer.param_groups[0]


def effective_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate the next step applies (to the first parameter group), as the optimizer sees it.

    For most optimizers that is the group's `lr`, which the schedule sets. Prodigy's steps are `d x lr`,
    `d` being its own estimate (x Adam's bias correction when that is on), so that is its rate.
    Schedule-free AdamW steps with `lr` (the warm-up is the schedule's). Plain Python numbers only:
    reading them never waits for the GPU.
    """
    group = optimizer.param_groups[0]
    if not is_prodigy(optimizer):
        return float(group["lr"])
    lr = max(g["lr"] for g in optimizer.param_groups)  # Prodigy's own rule (groups share one rate or have 0)
    correction = 1.0
    if group["use_bias_correction"]:
        beta1, beta2 = group["betas"]
        k = group["k"]
        correction = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1))
    return float(group["d"] * lr * correction)


@contextlib.contextmanager
def evaluation_weights(optimizer: torch.optim.Optimizer | None):
    """Inside the block the parameters hold the weights to evaluate: schedule-free AdamW's average x.
    After it they hold exactly the training weights y they held before. Other optimizers: no change.

    `optimizer.eval()` / `.train()` convert y -> x -> y by interpolating with the optimizer's z, which is
    not exact in floating point: the weights would drift by rounding at every sample or save, and since
    only rank 0 saves, the ranks' replicas would drift apart. So y is copied first and put back after.
    The copy costs the trained weights' size once more while the block runs (as EMA's swap does).
    """
    if optimizer is None or not is_schedule_free(optimizer) or not optimizer.param_groups[0]["train_mode"]:
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        training_weights = [p.detach().clone() for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()  # the optimizer's own flag back in train mode...
        with torch.no_grad():
            for p, saved in zip(params, training_weights):
                p.copy_(saved)  # ...and the weights exactly as they were


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
    """Multiplier of the base LR at each optimizer step: linear warm-up, then the chosen schedule.

    A pure function of the step, so a resumed run (LambdaLR keeps only the step count) continues the
    same curve, whatever the GPU count.
    """
    warmup = cfg.lr_warmup_steps
    decay_steps = max(1, total_steps - warmup)
    schedule = cfg.lr_scheduler
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"training.lr_scheduler: unknown schedule {schedule!r}; use one of {', '.join(LR_SCHEDULES)}")

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / decay_steps)
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return _cosine(progress)
        if schedule == "cosine_with_restarts":
            # Each of lr_cycles cycles restarts at the full rate; the last one ends at 0 (as diffusers' and
            # kohya's hard restarts do).
            if progress >= 1.0:
                return 0.0
            return _cosine((progress * cfg.lr_cycles) % 1.0)
        if schedule == "polynomial":
            return (1.0 - progress) ** cfg.lr_power
        if schedule == "warmup_stable_decay":
            stable = 1.0 - min(1.0, cfg.lr_decay_fraction)
            if progress <= stable:
                return 1.0
            return _cosine((progress - stable) / (1.0 - stable))
        return 1.0  # constant
    return factor


def _cosine(progress: float) -> float:
    """Half a cosine from 1 (progress 0) to 0 (progress 1)."""
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
