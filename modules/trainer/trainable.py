"""What trains, where the model lives, and the CUDA settings that depend on it.

`prepare_trainable` freezes the model, then makes trainable what the config trains - LoRA adapters, or
the whole denoiser (and text encoders) in fp32 master weights - and places the model as the run's
parallelism says. `trains_convolutions` tells whether cuDNN's autotuning can pay back its trials
(`training.cudnn_benchmark = auto`), `configure_cuda` applies the settings a CUDA run starts with.
"""
from __future__ import annotations

import logging

import torch

from modules.trainer.parallelism import Parallelism

log = logging.getLogger("tandem")


def prepare_trainable(bundle, training, parallelism: Parallelism, device: torch.device) -> list[torch.nn.Parameter]:
    """Choose what trains (LoRA adapters or the whole UNet/transformer, `training` being the run's
    `TrainingConfig`) and move the model to `device` as `parallelism` places it; returns the trained
    parameters."""
    t = training
    for m in bundle.modules().values():
        m.requires_grad_(False)
    trained_encoders = bundle.trainable_text_encoders() if t.train_text_encoder else []
    if t.method == "lora":
        from modules.model.lora import add_lora
        params = add_lora(bundle, t)
    else:
        bundle.denoiser.requires_grad_(True)
        # Full fine-tune keeps fp32 master weights; autocast does the rest. (load_model already gave
        # fp32; a no-op cast would only make diffusers warn about transformers' fp32 modules.)
        if next(bundle.denoiser.parameters()).dtype != torch.float32:
            bundle.denoiser.to(torch.float32)
        params = [p for p in bundle.denoiser.parameters()]
        for te in trained_encoders:
            te.requires_grad_(True)
            te.to(torch.float32)
            params += list(te.parameters())
    for dead_end in bundle.unused_modules():
        dead_end.requires_grad_(False)  # no gradient ever reaches them (see `ModelFamily.unused_modules`)
    if t.gradient_checkpointing:
        parallelism.checkpoint_activations(bundle)
    parallelism.place(bundle, [bundle.denoiser, *trained_encoders], device)
    if t.channels_last:
        # NHWC convolution weights (4-D tensors only); a convolution then runs in NHWC and so do its
        # outputs, whatever the layout of the latents fed in. Parameters keep their identity (their
        # `.data` is replaced), so `params` stays valid; DDP, the optimizer and EMA, built later,
        # see the new layout. Every writer of weights (backups, full saves, LoRA files) stores
        # contiguous copies, which safetensors requires.
        bundle.denoiser.to(memory_format=torch.channels_last)
    bundle.denoiser.train()
    for te in bundle.text_encoders:
        te.train(any(te is trained for trained in trained_encoders))
    return params


def trained_weights(bundle, params: list[torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """Name -> tensor of every parameter of `params` (what a backup stores): `unet.…` / `transformer.…`,
    `text_encoder_0.…`."""
    wanted = {id(p) for p in params}
    modules = {bundle.denoiser_name: bundle.denoiser,
               **{f"text_encoder_{i}": te for i, te in enumerate(bundle.text_encoders)}}
    return {f"{prefix}.{name}": p for prefix, m in modules.items()
            for name, p in m.named_parameters() if id(p) in wanted}


def trains_convolutions(modules) -> bool:
    """Whether any convolution's own weight trains: cuDNN's autotuning pays back its trials there
    (the weight-gradient kernels), not where frozen convolutions only pass gradients through."""
    return any(isinstance(m, torch.nn.modules.conv._ConvNd) and any(p.requires_grad for p in m.parameters(recurse=False))
               for root in modules for m in root.modules())


def configure_cuda(device: torch.device, training) -> None:
    """CUDA's settings for the run (`training`: its `TrainingConfig`): TF32, cuDNN autotuning while caching,
    attention kernels, the memory cap, fast pinning for backups. Nothing on other devices."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = training.tf32
    torch.backends.cudnn.allow_tf32 = training.tf32
    # `auto` decides once it is known what trains (`decide_cudnn_autotuning`): caching runs untuned.
    torch.backends.cudnn.benchmark = training.cudnn_benchmark == "on"
    # cuDNN's attention backward fails at Flux-size shapes on H100 with torch 2.11
    # ("mha_graph.execute ... is_good()"); flash and memory-efficient attention serve every shape we train.
    torch.backends.cuda.enable_cudnn_sdp(False)
    from modules.trainer.split_probe import cap_device_memory
    cap_device_memory(device)
    from modules.util.host_copy import use_fast_pinning
    use_fast_pinning()  # a full fine-tune's first backup: 2.4-3.7 s instead of 7.7-8.5 s on H100 hosts


def decide_cudnn_autotuning(device: torch.device, setting: str, modules) -> None:
    """`training.cudnn_benchmark = auto` (`setting`) on CUDA: autotune the training steps only when a
    convolution weight of `modules` trains."""
    if device.type != "cuda" or setting != "auto":
        return
    tuning = trains_convolutions(modules)
    torch.backends.cudnn.benchmark = tuning
    log.info("cuDNN autotuning (training.cudnn_benchmark=auto): %s.",
             "on for the training steps: convolution weights train" if tuning else
             "off: no convolution weight trains, so it would only lengthen the start")
