"""The built-in tiny Qwen-Image and Z-Image models (`builtin:demo-qwen`, `builtin:demo-zimage`), built locally.

Like the other built-in models (`demo.py`, `dit_demo.py`) they let training, multi-GPU, saving and sampling
of their families run end to end on a CPU in minutes, offline, and show what they learn:

- the **transformer** has the real architecture at a tiny width (64, 4 heads; random weights, fixed seed);
- the **VAE** is the demos' hand-set thumbnail codec: for Qwen-Image its own VAE class set up so
  (`demo_qwen_vae.py`), for Z-Image the 16-channel AutoencoderKL of the SD3 and Flux demos;
- the **text encoder** and **tokenizer** are a tiny Qwen2.5-VL / Qwen3 and a Qwen-style tokenizer made
  here (`llm_demo.py`);
- the **scheduler** is the family's: Qwen-Image's (shift by image size), Z-Image-Turbo's (a fixed 3).

Every build is byte-for-byte the same; the folder is written once into `$TANDEM_HOME/demo-qwen` or
`demo-zimage` (see `demo.default_demo_root`) and read like any diffusers folder.
"""
from __future__ import annotations

from pathlib import Path

import torch

_SEED = 5321
_WIDTH = 64
"""Transformer width (4 heads of 16)."""


def ensure_llm_demo(family: str, root: Path | None = None) -> Path:
    """The `builtin:demo-<family>` folder (`qwen` or `zimage`), built on first use, safely from several processes."""
    from modules.model.demo import default_demo_root, ensure_built_model

    root = Path(root) if root is not None else default_demo_root(f"demo-{family}")
    return ensure_built_model(root, lambda folder: _build(family, folder))


def _build(family: str, folder: Path) -> None:
    from .llm_demo import demo_qwen_tokenizer

    tokenizer = demo_qwen_tokenizer()
    pipeline = _qwen_pipeline(tokenizer) if family == "qwen" else _zimage_pipeline(tokenizer)
    pipeline.save_pretrained(folder, safe_serialization=True)


def _palette_statistics() -> tuple[float, float]:
    """Mean and spread of the demo palette's colour components as pixels in [-1, 1]."""
    from modules.data.demo_dataset import COLOURS

    palette = torch.tensor(list(COLOURS.values()), dtype=torch.float64) / 127.5 - 1.0
    return round(palette.mean().item(), 5), round(palette.std().item(), 5)


def _qwen_pipeline(tokenizer):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    from modules.model.demo_qwen_vae import build_demo_qwen_vae

    from .llm_demo import TEXT_WIDTH, tiny_qwen25_vl

    mean, std = _palette_statistics()
    vae = build_demo_qwen_vae(latents_mean=[mean] * 3 + [0.0] * 13, latents_std=[std] * 3 + [1.0] * 13)
    torch.manual_seed(_SEED)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=_WIDTH // 16, joint_attention_dim=TEXT_WIDTH, axes_dims_rope=(4, 6, 6))
    # Qwen-Image's scheduler: the shift grows with the image's token count (256 to 8192 tokens).
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=tiny_qwen25_vl(tokenizer, _SEED + 1),
                             tokenizer=tokenizer, transformer=transformer)


def _zimage_pipeline(tokenizer):
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    from modules.model.demo_vae import build_demo_vae

    from .llm_demo import TEXT_WIDTH, tiny_qwen3

    mean, std = _palette_statistics()
    vae = build_demo_vae(scaling_factor=round(1.0 / std, 5), latent_channels=16, shift_factor=mean)
    torch.manual_seed(_SEED)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=_WIDTH, n_layers=2, n_refiner_layers=1,
        n_heads=_WIDTH // 16, n_kv_heads=_WIDTH // 16, cap_feat_dim=TEXT_WIDTH, axes_dims=[4, 6, 6],
        axes_lens=[1024, 128, 128])
    # Z-Image-Turbo's scheduler: a fixed shift of 3.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=tiny_qwen3(tokenizer, _SEED + 1),
                          tokenizer=tokenizer, transformer=transformer)
