"""The diffusion training objective: noise, timesteps, target and loss weighting.

Noise and timesteps are drawn for the whole *global* batch from a generator keyed by
(seed, step, micro-batch) and each rank takes its slice. So the random numbers a sample sees do not
depend on how many ranks share the batch: 2 GPUs x batch B compute exactly what 1 GPU x batch 2B does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from modules.util.batch_slice import BatchSlice


@dataclass
class NoiseDraw:
    noise: torch.Tensor
    timesteps: torch.Tensor


def _global_draw_shape(latent_shape: tuple[int, ...], part: BatchSlice) -> tuple[int, ...]:
    if latent_shape[0] != part.size:
        raise ValueError(f"latents for {latent_shape[0]} samples, but this rank's part of the batch is {part.size}")
    return (part.total, *latent_shape[1:])


def draw_noise(latent_shape: tuple[int, ...], num_timesteps: int, seed: int, step: int, micro: int,
               part: BatchSlice, device: torch.device, offset_noise: float = 0.0) -> NoiseDraw:
    """This rank's part of the global batch's noise and timesteps (latent_shape is the local shape).

    Drawn on the training device: a CPU draw would cost every rank host time that grows with the
    number of GPUs, and its copy from pageable memory makes the CPU wait for the GPU. A generator of
    one device type gives the same numbers for the same key on any GPU, so N x B == 1 x NB holds on
    each device type (CPU and GPU draws differ from each other).
    """
    gen = torch.Generator(device=device).manual_seed(hash((seed, step, micro)) & 0x7FFF_FFFF_FFFF_FFFF)
    global_shape = _global_draw_shape(latent_shape, part)
    noise = torch.randn(global_shape, generator=gen, device=device)
    timesteps = torch.randint(0, num_timesteps, (global_shape[0],), generator=gen, device=device)
    if offset_noise > 0:
        noise = noise + offset_noise * torch.randn(global_shape[0], global_shape[1], 1, 1, generator=gen, device=device)
    mine = slice(part.offset, part.offset + part.size)
    return NoiseDraw(noise[mine], timesteps[mine])


def training_target(scheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                    prediction_type: str) -> torch.Tensor:
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"unknown prediction type {prediction_type!r}; use epsilon or v_prediction")


def snr(scheduler, timesteps: torch.Tensor) -> torch.Tensor:
    alphas_cumprod = scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
    return alphas_cumprod / (1 - alphas_cumprod)


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B] mean-squared error of each sample; with a `mask` ([B, 1, H, W] loss weights at latent resolution,
    `data.masks`), the mask-weighted mean: a latent of weight 0 adds nothing to the loss or its gradient, and a
    sample's loss keeps its scale whatever the masked area (a sample weighted 0 everywhere has loss 0)."""
    error = F.mse_loss(pred.float(), target.float(), reduction="none")
    dims = tuple(range(1, pred.ndim))
    if mask is None:
        return error.mean(dim=dims)
    if mask.shape[0] != pred.shape[0] or mask.shape[-2:] != pred.shape[-2:]:
        raise ValueError(f"loss mask of shape {list(mask.shape)} for predictions of shape {list(pred.shape)}; "
                         "masks are cached at latent resolution (image size / 8)")
    weights = mask.float().expand_as(error)
    return (error * weights).sum(dim=dims) / weights.sum(dim=dims).clamp_min(torch.finfo(torch.float32).tiny)


def weighted_mean(per_sample: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The micro-batch's loss: the mean over its samples of each one's loss x its weight (a concept's
    `loss_weight`, as kohya weighs regularisation images by prior_loss_weight)."""
    if weights is None:
        return per_sample.mean()
    return (per_sample * weights.to(per_sample.device, per_sample.dtype)).mean()


def diffusion_loss(pred: torch.Tensor, target: torch.Tensor, scheduler, timesteps: torch.Tensor,
                   prediction_type: str, min_snr_gamma: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean-squared error, optionally with min-SNR-gamma weighting (Hang et al. 2023): the batch's mean."""
    return diffusion_per_sample(pred, target, scheduler, timesteps, prediction_type, min_snr_gamma, mask).mean()


def diffusion_per_sample(pred: torch.Tensor, target: torch.Tensor, scheduler, timesteps: torch.Tensor,
                         prediction_type: str, min_snr_gamma: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B] `diffusion_loss` of each sample (mask-weighted with a mask)."""
    per_sample = per_sample_mse(pred, target, mask)
    if min_snr_gamma > 0:
        s = snr(scheduler, timesteps)
        weight = torch.clamp(s, max=min_snr_gamma) / (s + 1 if prediction_type == "v_prediction" else s)
        per_sample = per_sample * weight
    return per_sample


# ------------------------------------------------------------------ rectified flow (SD3, Flux)

def draw_flow_noise(latent_shape: tuple[int, ...], seed: int, step: int, micro: int, part: BatchSlice,
                    device: torch.device, offset_noise: float = 0.0, logit_mean: float = 0.0,
                    logit_std: float = 1.0) -> NoiseDraw:
    """This rank's part of the global batch's noise and flow times t in (0, 1), before any shift.

    t is logit-normal (the sigmoid of a normal draw), as SD3 was trained and as kohya sd-scripts and
    SimpleTuner train Flux. Keyed and sliced like `draw_noise`, so N ranks x B == 1 rank x N*B.
    """
    gen = torch.Generator(device=device).manual_seed(hash((seed, step, micro)) & 0x7FFF_FFFF_FFFF_FFFF)
    global_shape = _global_draw_shape(latent_shape, part)
    noise = torch.randn(global_shape, generator=gen, device=device)
    t = torch.sigmoid(logit_mean + logit_std * torch.randn(global_shape[0], generator=gen, device=device))
    if offset_noise > 0:
        noise = noise + offset_noise * torch.randn(global_shape[0], global_shape[1], 1, 1, generator=gen, device=device)
    mine = slice(part.offset, part.offset + part.size)
    return NoiseDraw(noise[mine], t[mine])


def flow_shift(scheduler_config, image_tokens: int) -> float:
    """How far the model's flow-match scheduler shifts t towards noise for an image of `image_tokens`
    tokens: SD3 and Flux.1-schnell by a fixed `shift`; Flux.1-dev by exp(mu), mu growing linearly
    with the image size (`use_dynamic_shifting`, as `FluxPipeline.calculate_shift` computes it)."""
    config = dict(scheduler_config)
    if not config.get("use_dynamic_shifting"):
        return float(config.get("shift", 1.0))
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    mu = base_shift + slope * (image_tokens - base_len)
    return float(mu) if config.get("time_shift_type", "exponential") == "linear" else math.exp(mu)


def shift_times(t: torch.Tensor, shift: float) -> torch.Tensor:
    """t -> shift * t / (1 + (shift - 1) * t): the scheduler's time shift (exp(mu) / (exp(mu) + 1/t - 1))."""
    return shift * t / (1 + (shift - 1) * t)


def flow_noisy(latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The point at time t on the straight path from the latents (t = 0) to the noise (t = 1)."""
    t = t.view(-1, *([1] * (latents.ndim - 1))).to(latents.dtype)
    return (1 - t) * latents + t * noise


def flow_per_sample(prediction: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B] mean-squared error of each sample's velocity (noise - latents), the same weight for every t
    (mask-weighted with a mask).

    The prediction is compared in the latents' layout (Flux's objective unpacks its 2x2-patch tokens before
    the loss), so a mask at latent resolution lines up with it for every family."""
    return per_sample_mse(prediction, target, mask)
