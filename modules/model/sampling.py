"""Render sample images from the model being trained, through the stock diffusers pipelines.

Using `StableDiffusionPipeline` / `StableDiffusionXLPipeline` on the bundle's own modules means a
sample shows exactly what users will get when they load the result in diffusers (LoRA adapters
included, since peft layers sit inside the UNet).
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from modules.config.train_config import SamplePromptConfig

from .bundle import ModelBundle


def render_samples(
    bundle: ModelBundle,
    prompts: Sequence[SamplePromptConfig],
    resolution: int,
    inference_steps: int = 20,
    guidance_scale: float = 7.0,
    device: torch.device | str | None = None,
) -> list:
    """One PIL image per prompt, each from its own seed, so samples are comparable over training.

    Modules are switched to eval mode (and, with `device`, moved there) for the render and restored
    afterwards, so this can be called in the middle of training.
    """
    if inference_steps < 1:
        raise ValueError(f"sampling.inference_steps is {inference_steps}; it must be at least 1")
    modules = bundle.modules()
    was_training = {name: module.training for name, module in modules.items()}
    home = {name: next(module.parameters()).device for name, module in modules.items()}
    target = torch.device(device) if device is not None else bundle.device
    try:
        for module in modules.values():
            module.eval()
            module.to(target)
        pipeline = _pipeline(bundle)
        multiple = pipeline.vae_scale_factor * 2 ** (len(bundle.unet.config.block_out_channels) - 1)
        images = []
        with torch.no_grad(), _autocast_for(bundle, target):
            for prompt in prompts:
                width = _round_to(prompt.width or resolution, multiple)
                height = _round_to(prompt.height or resolution, multiple)
                # A CPU generator gives the same starting noise on every device.
                generator = torch.Generator("cpu").manual_seed(int(prompt.seed))
                result = pipeline(
                    prompt=prompt.prompt, negative_prompt=prompt.negative_prompt or None,
                    width=width, height=height, num_inference_steps=inference_steps,
                    guidance_scale=guidance_scale, generator=generator, output_type="pil",
                )
                images.append(result.images[0])
        return images
    finally:
        for name, module in modules.items():
            module.to(home[name])
            module.train(was_training[name])


def _pipeline(bundle: ModelBundle):
    from diffusers import DDIMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    base = bundle.extra.get("scheduler", bundle.noise_scheduler)
    # DDIM is deterministic for a given seed and good at few steps; "trailing" spacing reaches the
    # last training timestep, which matters for v-prediction and zero-terminal-SNR models.
    scheduler = DDIMScheduler.from_config(
        base.config, prediction_type=bundle.prediction_type, timestep_spacing="trailing", clip_sample=False,
    )
    if bundle.model_type == "sdxl":
        pipeline = StableDiffusionXLPipeline(
            vae=bundle.vae, text_encoder=bundle.text_encoders[0], text_encoder_2=bundle.text_encoders[1],
            tokenizer=bundle.tokenizers[0], tokenizer_2=bundle.tokenizers[1], unet=bundle.unet,
            scheduler=scheduler, add_watermarker=False,
        )
    else:
        pipeline = StableDiffusionPipeline(
            vae=bundle.vae, text_encoder=bundle.text_encoders[0], tokenizer=bundle.tokenizers[0],
            unet=bundle.unet, scheduler=scheduler, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False,
        )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _autocast_for(bundle: ModelBundle, device: torch.device):
    """Autocast to the lowest storage precision in the bundle, so mixed-dtype parts fit together."""
    dtypes = {p.dtype for module in bundle.modules().values() for p in module.parameters()}
    low = [d for d in (torch.float16, torch.bfloat16) if d in dtypes]
    if not low:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=low[0])


def _round_to(size: int, multiple: int) -> int:
    return max(multiple, int(size) // multiple * multiple)
