"""The built-in tiny Lumina 2 model (`builtin:demo-lumina2`), built locally.

Like the other built-in models (`demo.py`, `dit_demo.py`, `llm_demo_models.py`) it lets training, multi-GPU,
saving and sampling of its family run end to end on a CPU in minutes, offline, and shows what it learns:

- the **transformer** has the real architecture at a tiny width (64, 4 heads of 16 with 2 key/value heads - the
  grouped heads of the real model, so q, k and v have different widths as there; random weights, fixed seed);
- the **VAE** is the demos' hand-set thumbnail codec as the 16-channel AutoencoderKL of the SD3, Flux and Z-Image
  demos (Lumina 2 uses Flux.1's VAE);
- the **text encoder** and **tokenizer** are a tiny Gemma 2 and a Gemma-style tokenizer made here (`gemma_demo.py`);
- the **scheduler** is Lumina-Image 2.0's (a fixed shift of 6).

Every build is byte-for-byte the same; the folder is written once into `$TANDEM_HOME/demo-lumina2` (see
`demo.default_demo_root`) and read like any diffusers folder.
"""
from __future__ import annotations

from pathlib import Path

import torch

_SEED = 6421
_WIDTH = 64


def ensure_lumina2_demo(root: Path | None = None) -> Path:
    """The `builtin:demo-lumina2` folder, built on first use, safely from several processes."""
    from modules.model.demo import default_demo_root, ensure_built_model

    root = Path(root) if root is not None else default_demo_root("demo-lumina2")
    return ensure_built_model(root, _build)


def _build(folder: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    from modules.model.demo_vae import build_demo_vae

    from .gemma_demo import TEXT_WIDTH, demo_gemma_tokenizer, tiny_gemma2
    from .llm_demo_models import _palette_statistics

    tokenizer = demo_gemma_tokenizer()
    mean, std = _palette_statistics()
    vae = build_demo_vae(scaling_factor=round(1.0 / std, 5), latent_channels=16, shift_factor=mean)
    torch.manual_seed(_SEED)
    transformer = Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, hidden_size=_WIDTH, num_layers=2, num_refiner_layers=1,
        num_attention_heads=_WIDTH // 16, num_kv_heads=2, multiple_of=16, axes_dim_rope=(4, 6, 6),
        cap_feat_dim=TEXT_WIDTH)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False)
    pipeline = Lumina2Pipeline(transformer=transformer, scheduler=scheduler, vae=vae,
                               text_encoder=tiny_gemma2(tokenizer, _SEED + 1), tokenizer=tokenizer)
    pipeline.save_pretrained(folder, safe_serialization=True)
