"""The diffusion training objective: noise, timesteps, target and loss weighting.

Noise and timesteps are drawn for the whole *global* batch from a generator keyed by
(seed, step, micro-batch) and each rank takes its slice. So the random numbers a sample sees do not
depend on how many ranks share the batch: 2 GPUs x batch B compute exactly what 1 GPU x batch 2B does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class NoiseDraw:
    noise: torch.Tensor
    timesteps: torch.Tensor


def draw_noise(latent_shape: tuple[int, ...], num_timesteps: int, seed: int, step: int, micro: int,
               rank: int, world_size: int, device: torch.device, offset_noise: float = 0.0) -> NoiseDraw:
    """This rank's slice of the global batch's noise and timesteps (latent_shape is the local shape).

    Drawn on the training device: a CPU draw would cost every rank host time that grows with the
    number of GPUs, and its copy from pageable memory makes the CPU wait for the GPU. A generator of
    one device type gives the same numbers for the same key on any GPU, so N x B == 1 x NB holds on
    each device type (CPU and GPU draws differ from each other).
    """
    local = latent_shape[0]
    gen = torch.Generator(device=device).manual_seed(hash((seed, step, micro)) & 0x7FFF_FFFF_FFFF_FFFF)
    global_shape = (local * world_size, *latent_shape[1:])
    noise = torch.randn(global_shape, generator=gen, device=device)
    timesteps = torch.randint(0, num_timesteps, (global_shape[0],), generator=gen, device=device)
    if offset_noise > 0:
        noise = noise + offset_noise * torch.randn(global_shape[0], global_shape[1], 1, 1, generator=gen, device=device)
    part = slice(rank * local, (rank + 1) * local)
    return NoiseDraw(noise[part], timesteps[part])


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


def diffusion_loss(pred: torch.Tensor, target: torch.Tensor, scheduler, timesteps: torch.Tensor,
                   prediction_type: str, min_snr_gamma: float) -> torch.Tensor:
    """Mean-squared error, optionally with min-SNR-gamma weighting (Hang et al. 2023)."""
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=tuple(range(1, pred.ndim)))
    if min_snr_gamma > 0:
        s = snr(scheduler, timesteps)
        weight = torch.clamp(s, max=min_snr_gamma) / (s + 1 if prediction_type == "v_prediction" else s)
        per_sample = per_sample * weight
    return per_sample.mean()

