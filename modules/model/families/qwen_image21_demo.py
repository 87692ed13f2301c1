"""The built-in tiny Qwen-Image 2.1 model (`builtin:demo-qwen_image21`), built locally, and the `qwen3-vl` text-encoder
kind's tiny builder.

Like the other built-in models (`llm_demo_models.py`) it lets training, multi-GPU, saving and sampling of its family
run end to end on a CPU in minutes, offline, and shows what it learns:

- the **transformer** has the real architecture (single-stream, block-causal, one shared modulation) at a tiny width
  (64, 4 heads of 16, two blocks; random weights, fixed seed);
- the **VAE** is the demos' hand-set thumbnail codec in 2.1's own class (`demo_qwen21_vae.py`): 16x smaller, 64
  channels (21 copies of the thumbnail's colours), RGBA, so a 64 px image is a 4x4 latent;
- the **text encoder** is a tiny Qwen3-VL (text width 32, two layers, a one-block vision tower that text never
  reaches) and the **processor** folder holds the demo's Qwen-style tokenizer with Qwen-VL's special tokens and a
  chat template for them (`demo_qwen3vl_tokenizer`), beside the image and video processors' configs;
- the **scheduler** is the family's (shift by image size, as Qwen-Image's).

The folder is written component by component: a `QwenImage21Pipeline` object cannot be made without a
`Qwen3VLProcessor`, whose video processor needs torchvision, which Tandem does not depend on. Every build is
byte-for-byte the same; it is written once into `$TANDEM_HOME/demo-qwen_image21` (see `demo.default_demo_root`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

_SEED = 7321
_WIDTH = 64
"""Transformer width (4 heads of 16)."""
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen-VL's special tokens of an image or video in the text (the processor needs their ids)."""
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}"
    "{%- elif part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
"""Qwen-VL's chat template for plain and multimodal messages (content as a string or a list of parts)."""
_PATCH = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
          "image_std": [0.5] * 3, "processor_class": "Qwen3VLProcessor"}
"""What Qwen3-VL's image and video processors share (16 px patches, 2x2 merged)."""


def ensure_qwen_image21_demo(root: Path | None = None) -> Path:
    """The `builtin:demo-qwen_image21` folder, built on first use, safely from several processes."""
    from modules.model.demo import default_demo_root, ensure_built_model

    root = Path(root) if root is not None else default_demo_root("demo-qwen_image21")
    return ensure_built_model(root, _build)


def demo_qwen3vl_tokenizer():
    """The demo's Qwen-style tokenizer (`llm_demo.demo_qwen_tokenizer`) with Qwen-VL's special tokens and chat
    template."""
    from .llm_demo import IM_END, IM_START, demo_qwen_tokenizer

    tokenizer = demo_qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, *VISION_TOKENS]})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def tiny_qwen3_vl(tokenizer, seed: int):
    """A tiny random `Qwen3VLForConditionalGeneration` (Qwen-Image 2.1's text encoder class) over `tokenizer`'s
    vocabulary; its vision tower is one block (text-to-image never runs it)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from .llm_demo import TEXT_WIDTH, _special_ids

    torch.manual_seed(seed)
    ids = _special_ids(tokenizer)
    vision_ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in
                  zip(("vision_start", "vision_end", "image", "video"), VISION_TOKENS)}
    vision_ids = {k: v for k, v in vision_ids.items() if isinstance(v, int) and v != tokenizer.unk_token_id}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=2048, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}, **ids),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_WIDTH,
                           deepstack_visual_indexes=[0], num_position_embeddings=64),
        tie_word_embeddings=False, **ids, **vision_ids)
    return Qwen3VLForConditionalGeneration(config).eval()


def write_processor_folder(tokenizer, folder: Path) -> None:
    """A `processor/` folder of Qwen3-VL's layout: the tokenizer, and the image and video processors' configs (16 px
    patches merged 2x2, as Qwen3-VL's), which a diffusers `QwenImage21Pipeline.from_pretrained` reads (with
    torchvision installed, which the video processor needs)."""
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    image = {**_PATCH, "image_processor_type": "Qwen2VLImageProcessorFast", "do_resize": True, "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
             "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
    video = {**_PATCH, "video_processor_type": "Qwen3VLVideoProcessor", "do_resize": True, "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "do_sample_frames": True,
             "fps": 2, "min_frames": 4, "max_frames": 768, "size": {"shortest_edge": 4096, "longest_edge": 25165824}}
    for name, config in (("preprocessor_config.json", image), ("video_preprocessor_config.json", video)):
        (folder / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _build(folder: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

    from modules.model.demo_qwen21_vae import build_demo_qwen21_vae
    from modules.model.saving import write_model_index

    from .llm_demo import TEXT_WIDTH
    from .llm_demo_models import _palette_statistics

    tokenizer = demo_qwen3vl_tokenizer()
    mean, std = _palette_statistics()
    vae = build_demo_qwen21_vae(latents_mean=[mean] * 63 + [0.0], latents_std=[std] * 63 + [1.0])
    torch.manual_seed(_SEED)
    transformer = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=64, out_channels=64, num_layers=2, attention_head_dim=16,
        num_attention_heads=_WIDTH // 16, context_in_dim=TEXT_WIDTH, mlp_ratio=3, axes_dims_rope=(4, 6, 6))
    # Qwen-Image 2.1's scheduler: the shift grows with the image's token count (256 to 8192 tokens).
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    text_encoder = tiny_qwen3_vl(tokenizer, _SEED + 1)
    for name, part in (("transformer", transformer), ("vae", vae), ("text_encoder", text_encoder)):
        part.save_pretrained(folder / name, safe_serialization=True)
    scheduler.save_pretrained(folder / "scheduler")
    write_processor_folder(tokenizer, folder / "processor")
    write_model_index(folder, "QwenImage21Pipeline",
                      {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "scheduler": scheduler},
                      {"processor": ["transformers", "Qwen3VLProcessor"], "sample_sigmas": None})
