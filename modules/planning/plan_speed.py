"""How fast a memory plan trains, roughly: what ranks the plans that fit, before anything runs.

The plan is chosen before any GPU is touched, so its speed is arithmetic, not a measurement: a step's compute
(6 x the denoiser's parameters x the tokens of a micro-batch, at `REFERENCE_FLOPS`) times what each saver costs
(`COST`, each from a measurement where one exists), and - with layer offload - the swapped blocks' weights over
the host link (`HOST_LINK_BYTES_PER_S`), once for the forward and again for the backward's recompute. The copies
overlap the compute (`modules/model/layer_offload.py`), so a step takes the longer of the two.

Only the ratio of compute to copying matters for the ranking. The reference is a fast card on PCIe 4.0; a
slower card (a consumer 24 GB one) hides the copies better, a PCIe 5.0 host link moves them twice as fast:
both favour layer offload more than this estimate does, so the plan leans towards the fp8 base when in doubt.

Torch-free, like the rest of the plan.
"""
from __future__ import annotations

from modules.planning.memory_need import Facts, Setup, offloaded_activation_bytes, sequence_tokens, swapped_bytes

REFERENCE_FLOPS = 400e12
"""Floating-point operations per second a step's matrix products reach (bf16, a large current GPU)."""
HOST_LINK_BYTES_PER_S = 25e9
"""Host-to-GPU copies from page-locked memory (PCIe 4.0 x16 in practice; 5.0 about twice)."""
COST = {
    "checkpointing": 1.33,  # a second forward in the backward: 8 instead of 6 x parameters x tokens
    "fp8": 1.16,  # Qwen-Image LoRA, 1 H200: 0.75 img/s with an fp8 base against 0.87 in bf16 (2026-11-28)
    "fsdp": 1.25,  # gathering every block twice per step, mostly overlapped (an SDXL LoRA 19% slower, 2 H100s)
    "activation_offload": 1.1,  # checkpointed inputs to host memory and back, overlapped
    "cpu_offload": 1.5,  # the optimizer step on the CPU and the shards' copies (a Flux.2 LoRA: 0.72 vs 0.84 img/s)
}
"""What each saver multiplies a step's time by."""
UNET_TOKEN_PIXELS = 16
"""A UNet's work per step counted as a transformer's with one token per 16 x 16 pixels (its blocks run at 1/8
to 1/64 of the pixels): a rough figure, only ever compared with the same UNet under another plan."""


def compute_seconds(f: Facts, cfg, setup: Setup, batch: int) -> float:
    """A step's compute on one GPU, before the savers' costs."""
    if f.sizes.denoiser_name == "unet":
        tokens = (cfg.data.resolution / UNET_TOKEN_PIXELS) ** 2
    else:
        tokens = sequence_tokens(f, cfg, setup)
    return 6 * f.sizes.denoiser.params * tokens * batch * cfg.training.gradient_accumulation_steps / REFERENCE_FLOPS


def step_seconds(f: Facts, cfg, setup: Setup, batch: int) -> float:
    """The estimated time of one optimizer step of `setup` with `batch` samples per micro-batch on a GPU."""
    seconds = compute_seconds(f, cfg, setup, batch)
    for saver in ("checkpointing", "fp8", "activation_offload", "cpu_offload"):
        if getattr(setup, saver):
            seconds *= COST[saver]
    if setup.strategy == "fsdp":
        seconds *= COST["fsdp"]
    if setup.offload_blocks:
        swapped, _ = swapped_bytes(f, "fp8" if setup.fp8 else cfg.model.unet_dtype, setup.offload_blocks)
        passes = 2 if setup.checkpointing else 1  # the backward's recompute needs the weights again
        # Offloaded activations come back over the same link in the backward.
        moved = passes * swapped + offloaded_activation_bytes(f, cfg, setup, batch)
        copying = moved * cfg.training.gradient_accumulation_steps / HOST_LINK_BYTES_PER_S
        seconds = max(seconds, copying)
    return seconds
