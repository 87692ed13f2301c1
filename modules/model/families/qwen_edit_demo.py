"""The built-in tiny Qwen-Image-Edit model (`builtin:demo-qwen_edit`), built locally like `llm_demo_models.py`'s.

It is the demo Qwen-Image (the same tiny transformer, the hand-set VAE, Qwen-Image's scheduler) as a
`QwenImageEditPlusPipeline` folder, whose text encoder - a tiny Qwen2.5-VL - keeps its vision tower (of one block)
and reads the control images as the pipeline's `Qwen2VLProcessor` hands them over:

- the **tokenizer** is the demo's Qwen-style one (`llm_demo.py`) with the words of Qwen-Image-Edit's prompt
  template and the vision tokens: the pipeline drops the first 64 tokens of every encoded prompt - its system
  prompt, as Qwen's own tokenizer splits it - and this one splits it into the same 64 (checked when built);
- `processor/` holds the tokenizer and Qwen2-VL's image processor's defaults (14 px patches, 2x2 merged).

Every build is byte-for-byte the same, written once into `$TANDEM_HOME/demo-qwen_edit`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
                 "background), then explain how the user's text instruction should alter or modify the image. Generate a "
                 "new image that meets the user's requirements while maintaining consistency with the original input where "
                 "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
"""`QwenImageEditPlusPipeline.prompt_template_encode` (the original edit pipeline's is the same)."""
EDIT_DROP = 64
"""`prompt_template_encode_start_idx`: the template's tokens before the user's part."""
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
_SEED = 5321


def demo_edit_tokenizer():
    """The demo tokenizer with Qwen-Image-Edit's template words and the vision tokens (see the module docstring)."""
    from .llm_demo import demo_qwen_tokenizer

    prefix = EDIT_TEMPLATE[:EDIT_TEMPLATE.index("{}")]
    # Qwen's tokenizer keeps " (", ")," and "'s" whole, and the Plus pipeline labels each image "Picture N:".
    words = tuple(dict.fromkeys(re.findall(r"[A-Za-z]+", prefix))) + ("(", "),", "'s", "Picture", ":")
    tokenizer = demo_qwen_tokenizer(words, VISION_TOKENS)
    if len(tokenizer(prefix).input_ids) != EDIT_DROP:
        raise RuntimeError(f"the demo tokenizer splits Qwen-Image-Edit's prompt template into "
                           f"{len(tokenizer(prefix).input_ids)} tokens, the pipeline drops {EDIT_DROP}; update "
                           "modules/model/families/qwen_edit_demo.py")
    return tokenizer


def write_processor(tokenizer, folder: Path) -> None:
    """`processor/` as the releases have it: the tokenizer and Qwen2-VL's image processor's config (defaults: 14 px
    patches, 2x2 merged). Written by parts: the processor class needs torchvision."""
    from transformers import Qwen2VLImageProcessorPil

    tokenizer.save_pretrained(folder / "processor")
    Qwen2VLImageProcessorPil().save_pretrained(folder / "processor")


def tiny_qwen25_vl_seeing(tokenizer, seed: int):
    """The demo's tiny Qwen2.5-VL, told its vision tokens (so its one-block vision tower reads images)."""
    from .llm_demo import tiny_qwen25_vl

    model = tiny_qwen25_vl(tokenizer, seed)
    start, pad, end = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    for config in {id(c): c for c in (model.config, model.model.config)}.values():
        config.image_token_id, config.vision_start_token_id, config.vision_end_token_id = pad, start, end
        config.video_token_id = pad
    return model


def ensure_qwen_edit_demo(root: Path | None = None) -> Path:
    """The `builtin:demo-qwen_edit` folder, built on first use, safely from several processes."""
    from modules.model.demo import default_demo_root, ensure_built_model

    root = Path(root) if root is not None else default_demo_root("demo-qwen_edit")
    return ensure_built_model(root, _build)


def _build(folder: Path) -> None:
    from diffusers import QwenImageEditPlusPipeline

    from .llm_demo_models import _qwen_pipeline

    tokenizer = demo_edit_tokenizer()
    base = _qwen_pipeline(tokenizer)  # the demo Qwen-Image's transformer, VAE and scheduler
    pipeline = QwenImageEditPlusPipeline(scheduler=base.scheduler, vae=base.vae,
                                         text_encoder=tiny_qwen25_vl_seeing(tokenizer, _SEED + 1), tokenizer=tokenizer,
                                         processor=None, transformer=base.transformer)
    pipeline.save_pretrained(folder, safe_serialization=True)
    write_processor(tokenizer, folder)
    index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
