"""Render sample images from the model being trained, through the family's stock diffusers pipeline.

Using the diffusers pipeline (`StableDiffusionPipeline`, `StableDiffusionXLPipeline`,
`StableDiffusion3Pipeline`, `FluxPipeline`) on the bundle's own modules means a sample shows exactly
what users will get when they load the result in diffusers (LoRA adapters included, since peft
layers sit inside the denoiser). Which pipeline and which arguments is the family's business
(`family.pipeline`, `family.pipeline_arguments`). A video family renders `frames` frames per prompt (a
`Clip`); an image family, and a video family asked for one frame, one image.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from modules.config.train_config import SamplePromptConfig
from modules.util.animation import Clip

from .bundle import ModelBundle
from .host_copies import move_home
from .sample_graphs import replayed_from_graphs
from .sample_texts import texts_ready


def render_samples(
    bundle: ModelBundle,
    prompts: Sequence[SamplePromptConfig],
    resolution: int,
    inference_steps: int = 20,
    guidance_scale: float = 7.0,
    device: torch.device | str | None = None,
    frames: int = 1,
    fps: float = 16.0,
    graphs: bool = True,
    on_prompt: Callable[[int], None] | None = None,
) -> list:
    """One PIL image per prompt, each from its own seed, so samples are comparable over training; a video
    family's `Clip` of `frames` frames at `fps` where `frames` > 1. With `graphs`, on a GPU, the denoiser's
    repeated calls replay from CUDA graphs (`sample_graphs.py`: the same pixels, less host time).

    Modules are switched to eval mode (and, with `device`, moved there) for the render and restored
    afterwards, so this can be called in the middle of training. Text encoders are left where they are when
    every text is kept encoded (`modules/model/sample_texts.py`). `on_prompt(i)` is called as prompt i starts
    (a sampling can take minutes: the GUI says how far it is).
    """
    if inference_steps < 1:
        raise ValueError(f"sampling.inference_steps is {inference_steps}; it must be at least 1")
    modules = bundle.sampling_modules()
    if texts_ready(bundle, prompts, guidance_scale):
        modules = {name: module for name, module in modules.items()
                   if not any(module is encoder for encoder in bundle.text_encoders)}
    was_training = {name: module.training for name, module in modules.items()}
    home = {name: next(module.parameters()).device for name, module in modules.items()}
    target = torch.device(device) if device is not None else bundle.device
    try:
        for module in modules.values():
            module.eval()
            module.to(target)
        pipeline = sampling_pipeline(bundle)
        # The graphs inside autocast: a capture uses the weights' casts autocast keeps while it is on.
        with torch.no_grad(), _autocast_for(bundle, target), without_cudnn_autotuning(), \
                replayed_from_graphs(bundle.denoiser, target, graphs) as calls:
            images = []
            for index, prompt in enumerate(prompts):
                if on_prompt is not None:
                    on_prompt(index)
                arguments = (bundle, pipeline, prompt, resolution, inference_steps, guidance_scale, frames, fps)
                try:
                    images.append(render_one(*arguments))
                except torch.cuda.OutOfMemoryError:
                    # The graphs hold a call's activations through the whole sampling, the VAE's decoding
                    # included: on a full GPU the prompt is rendered again without them (the same image).
                    if calls is None or not calls.graphs:
                        raise
                    calls.release("the GPU ran out of memory with the graphs held")
                    torch.cuda.empty_cache()
                    images.append(render_one(*arguments))
            return images
    finally:
        for name, module in modules.items():
            move_home(bundle, module, home[name])
            module.train(was_training[name])


def sampling_pipeline(bundle: ModelBundle):
    """The family's diffusers pipeline around the bundle's modules, progress bar off."""
    pipeline = bundle.family.pipeline(bundle)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def render_one(bundle: ModelBundle, pipeline, prompt: SamplePromptConfig, resolution: int, inference_steps: int,
               guidance_scale: float, frames: int = 1, fps: float = 16.0):
    """One prompt's image (or clip): its size rounded down to what the model accepts, its noise from its own seed."""
    multiple = bundle.family.sample_size_multiple(bundle)
    width = _round_to(prompt.width or resolution, multiple)
    height = _round_to(prompt.height or resolution, multiple)
    # A CPU generator gives the same starting noise on every device.
    generator = torch.Generator("cpu").manual_seed(int(prompt.seed))
    result = pipeline(width=width, height=height, num_inference_steps=inference_steps, generator=generator,
                      output_type="pil", **bundle.family.pipeline_arguments(bundle, prompt, guidance_scale),
                      **bundle.family.video_arguments(frames))
    rendered = bundle.family.sample_frames(result)
    return rendered[0] if len(rendered) == 1 else Clip(tuple(rendered), fps)


@contextlib.contextmanager
def without_cudnn_autotuning():
    """cuDNN's autotuning (`training.cudnn_benchmark`) pays for itself over thousands of training steps
    at a few shapes. A sampling calls the denoiser a few dozen times at shapes training never used (the
    guidance batch, the VAE decoder), where tuning costs seconds: tuned, the first sampling of the
    end-to-end job took 3.5-4.3 s longer than the second on H100s, about what tuning the VAE encoder
    costs at the start of caching (~3 s)."""
    cudnn = torch.backends.cudnn
    tuning = cudnn.benchmark
    cudnn.benchmark = False
    try:
        yield
    finally:
        cudnn.benchmark = tuning


def _autocast_for(bundle: ModelBundle, device: torch.device):
    """Autocast to the lowest storage precision in the bundle, so mixed-dtype parts fit together."""
    dtypes = {p.dtype for module in bundle.modules().values() for p in module.parameters()}
    low = [d for d in (torch.float16, torch.bfloat16) if d in dtypes]
    if not low:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=low[0])


def _round_to(size: int, multiple: int) -> int:
    return max(multiple, int(size) // multiple * multiple)
