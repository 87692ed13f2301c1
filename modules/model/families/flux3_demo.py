"""The built-in tiny Flux.3 model (`builtin:demo-flux3`), built locally.

Like the other built-in models it lets training, multi-GPU, saving and sampling of its family run end to end on a
CPU in minutes, offline, and shows what it learns:

- the **transformer** has the real architecture (per-mode blocks for the text, the image and the reference
  images, then joint single blocks) at a tiny width (64, 4 heads of 16; random weights, fixed seed);
- the **VAE** is Flux.2's demo codec (`dit_demo._flux2_vae`): Flux.3 uses Flux.2's packed autoencoder;
- the **text encoder** is a tiny Qwen3-VL (the `qwen3-vl` kind's builder, `qwen_image21_demo.tiny_qwen3_vl`) made
  33 layers deep, because the pipeline stacks the hidden states of layers 4, 8, ..., 32 (8 x 32 = 256 values per
  token), its residual branches damped as Flux.2's demo encoder's;
- the **scheduler** is the family's: a constant shift of 6.93, as `Flux3SetTimestepsStep` configures it.

Every build is byte-for-byte the same; it is written once into `$TANDEM_HOME/demo-flux3`.
"""
from __future__ import annotations

from pathlib import Path

import torch

_SEED = 9131
_WIDTH = 64
"""Transformer width (4 heads of 16)."""
TEXT_LAYERS = 33
"""Depth of the tiny text encoder: the pipeline reads layers 4 to 32 (one more, so the last read is no final one)."""


def ensure_flux3_demo(root: Path | None = None) -> Path:
    """The `builtin:demo-flux3` folder, built on first use, safely from several processes."""
    from modules.model.demo import default_demo_root, ensure_built_model

    root = Path(root) if root is not None else default_demo_root("demo-flux3")
    return ensure_built_model(root, _build)


def flux3_text_encoder(seed: int = _SEED + 1):
    """(a tiny random Qwen3-VL as deep as the pipeline reads, its tokenizer)."""
    from transformers import Qwen3VLForConditionalGeneration

    from .dit_demo import damped_residuals
    from .qwen_image21_demo import demo_qwen3vl_tokenizer, tiny_qwen3_vl

    tokenizer = demo_qwen3vl_tokenizer()
    config = tiny_qwen3_vl(tokenizer, seed).config
    config.text_config.num_hidden_layers = TEXT_LAYERS
    if getattr(config.text_config, "layer_types", None):
        config.text_config.layer_types = [config.text_config.layer_types[0]] * TEXT_LAYERS
    torch.manual_seed(seed)
    return damped_residuals(Qwen3VLForConditionalGeneration(config)).eval(), tokenizer


def flux3_scheduler():
    """Flux.3's sampling schedule: a constant shift of 6.93 (`Flux3SetTimestepsStep`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.93, use_dynamic_shifting=False)


def _build(folder: Path) -> None:
    from diffusers import Flux3Transformer2DModel

    from modules.model.saving import write_model_index

    from .dit_demo import _flux2_vae
    from .llm_demo import TEXT_WIDTH

    encoder, tokenizer = flux3_text_encoder()
    torch.manual_seed(_SEED)
    transformer = Flux3Transformer2DModel(
        in_channels=128, cond_in_channels=128, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=_WIDTH // 16, joint_attention_dim=8 * TEXT_WIDTH, timestep_channels=32,
        axes_dims_rope=(4, 4, 4, 4))
    parts = {"transformer": transformer, "vae": _flux2_vae(), "text_encoder": encoder, "scheduler": flux3_scheduler()}
    for name, part in parts.items():
        part.save_pretrained(folder / name, **({} if name == "scheduler" else {"safe_serialization": True}))
    tokenizer.save_pretrained(folder / "tokenizer")
    write_model_index(folder, "Flux3ModularPipeline", {**parts, "tokenizer": tokenizer})
