"""The built-in tiny Wan model (`builtin:demo-wan`), built locally.

Like the other built-in models (`demo.py`, `dit_demo.py`, `llm_demo_models.py`) it lets training, multi-GPU,
saving and sampling of Wan run end to end on a CPU in minutes, offline:

- the **transformer** is a `WanTransformer3DModel` at a tiny width (64, 4 heads of 16; random weights, fixed seed);
- the **VAE** is the demos' hand-set thumbnail codec as an `AutoencoderKLWan` (`demo_qwen_vae.py`): each
  latent frame is the 8x8 thumbnail of one video frame, so samples show what the transformer learned;
- the **text encoder** is a tiny random UMT5 encoder with the T5-style demo tokenizer (`dit_demo.py`);
- the **scheduler** is a flow-match Euler scheduler with Wan's 480p shift of 3 (the releases ship UniPC
  with `flow_shift` 3; the objective reads either).

Every build is byte-for-byte the same; the folder is written once into `$TANDEM_HOME/demo-wan` (see
`demo.default_demo_root`) and read like any diffusers folder.
"""
from __future__ import annotations

from pathlib import Path

import torch

_SEED = 6321
_WIDTH = 64
"""Transformer width (4 heads of 16)."""
TEXT_WIDTH = 32
"""The tiny UMT5's width (the transformer's `text_dim`)."""


def ensure_wan_demo(root: Path | None = None) -> Path:
    """The `builtin:demo-wan` folder, built on first use, safely from several processes."""
    from modules.model.demo import default_demo_root, ensure_built_model

    root = Path(root) if root is not None else default_demo_root("demo-wan")
    return ensure_built_model(root, _build)


def tiny_umt5(tokenizer, seed: int):
    """A tiny random UMT5 encoder for `tokenizer`."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_WIDTH, d_kv=8, d_ff=2 * TEXT_WIDTH, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        is_encoder_decoder=False, use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        tie_word_embeddings=False)
    return UMT5EncoderModel(config).eval()


def _build(folder: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from modules.model.demo_qwen_vae import build_demo_wan_vae

    from .dit_demo import demo_t5_tokenizer
    from .llm_demo_models import _palette_statistics

    mean, std = _palette_statistics()
    vae = build_demo_wan_vae(latents_mean=[mean] * 3 + [0.0] * 13, latents_std=[std] * 3 + [1.0] * 13)
    tokenizer = demo_t5_tokenizer()
    torch.manual_seed(_SEED)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=_WIDTH // 16, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=TEXT_WIDTH, freq_dim=32, ffn_dim=2 * _WIDTH, num_layers=2, rope_max_seq_len=64)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    WanPipeline(tokenizer=tokenizer, text_encoder=tiny_umt5(tokenizer, _SEED + 1), transformer=transformer, vae=vae,
                scheduler=scheduler).save_pretrained(folder, safe_serialization=True)
