"""The kinds of text encoder the model families use, as data: a family names its encoders' kinds
(`FamilyInfo.text_encoders`), and the code that handles text encoders asks this table, never the family.

What a kind decides:
- `trains`: whether `training.train_text_encoder` may train it (the CLIP encoders); T5 and the language models
  are always frozen;
- `language_model`: a decoder language model whose hidden states condition the denoiser. A family that loads
  such an encoder apart (`FamilyInfo.text_apart`) keeps only its decoder stack (`modules/model/text_apart.py`:
  `dropped` names the parts that are read and let go at once - an LM head, a vision tower - and
  `dropped_weights` the same parts' weight names, so its size is counted without them);
- `tiny`: `module:function` of a builder of a tiny random encoder of this kind (benchmarks and built-in demos
  build one instead of reading weights).

Torch-free, like the registry (`registry.py`): validation, the GUI, the docs and the memory plan read it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextEncoderKind:
    name: str
    title: str
    """What the docs call it."""
    classes: tuple[str, ...]
    """The transformers classes that hold this kind's checkpoints (as `config.json`'s `architectures` names them)."""
    trains: bool = False
    """`training.train_text_encoder` trains it (CLIP); otherwise it is always frozen."""
    language_model: bool = False
    """A decoder language model (chat template, hidden states of a chosen layer)."""
    dropped: tuple[str, ...] = ("lm_head",)
    """Attributes of the loaded model (or of its inner `.model`) that encoding never uses, deleted once read."""
    dropped_weights: tuple[str, ...] = ("lm_head.",)
    """The checkpoint's weight-name prefixes of those parts (not counted in the encoder's size)."""
    tiny: str = ""
    """`module:function(tokenizer, seed)` building a tiny random encoder of this kind, or empty."""


_LLM = {"language_model": True}
TEXT_ENCODER_KINDS: dict[str, TextEncoderKind] = {kind.name: kind for kind in (
    TextEncoderKind("clip-l", "CLIP-L", ("CLIPTextModel", "CLIPTextModelWithProjection"), trains=True),
    TextEncoderKind("clip-g", "CLIP-G", ("CLIPTextModelWithProjection",), trains=True),
    TextEncoderKind("openclip-h", "OpenCLIP-H", ("CLIPTextModel",), trains=True),
    TextEncoderKind("openclip-bigg", "OpenCLIP-bigG", ("CLIPTextModelWithProjection",), trains=True),
    TextEncoderKind("t5-xxl", "T5-XXL", ("T5EncoderModel",)),
    TextEncoderKind("umt5-xxl", "UMT5-XXL", ("UMT5EncoderModel",)),
    TextEncoderKind("mistral-small-3.1", "Mistral-Small-3.1", ("Mistral3ForConditionalGeneration",), **_LLM),
    TextEncoderKind("qwen3", "Qwen3", ("Qwen3Model", "Qwen3ForCausalLM"), tiny="modules.model.families.llm_demo:tiny_qwen3",
                    **_LLM),
    TextEncoderKind("qwen2.5-vl", "Qwen2.5-VL", ("Qwen2_5_VLForConditionalGeneration",),
                    dropped=("visual", "lm_head"), dropped_weights=("visual.", "model.visual.", "lm_head."),
                    tiny="modules.model.families.llm_demo:tiny_qwen25_vl", **_LLM),
    TextEncoderKind("qwen2.5-vl-vision", "Qwen2.5-VL with its vision tower", ("Qwen2_5_VLForConditionalGeneration",),
                    dropped_weights=("lm_head.",), tiny="modules.model.families.qwen_edit_demo:tiny_qwen25_vl_seeing",
                    **_LLM),
    TextEncoderKind("qwen3-vl", "Qwen3-VL", ("Qwen3VLForConditionalGeneration",),
                    dropped=("visual", "lm_head"), dropped_weights=("visual.", "model.visual.", "lm_head."),
                    tiny="modules.model.families.qwen_image21_demo:tiny_qwen3_vl", **_LLM),
    # Named by the families of 2026 (Lumina 2's Gemma 2, HiDream's Llama 3.1 beside T5 and two CLIPs).
    TextEncoderKind("gemma", "Gemma", ("Gemma2Model", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3Model"),
                    tiny="modules.model.families.gemma_demo:tiny_gemma2", **_LLM),
    TextEncoderKind("llama", "Llama", ("LlamaModel", "LlamaForCausalLM"), **_LLM),
)}
"""Every kind, by name."""


def kind_of_class(class_name: str) -> TextEncoderKind | None:
    """The kind whose checkpoints are of transformers class `class_name` (a benchmark's `random <class>`
    too), or None."""
    name = class_name.removeprefix("random ")
    return next((kind for kind in TEXT_ENCODER_KINDS.values() if name in kind.classes), None)


def kept_weight(class_name: str, tensor: str) -> bool:
    """Whether weight `tensor` of a checkpoint of `class_name` stays in the part that encodes."""
    kind = kind_of_class(class_name)
    return not tensor.startswith(kind.dropped_weights if kind else ("lm_head.",))
