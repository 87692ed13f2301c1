"""The text side of the built-in Qwen-Image and Z-Image models: a Qwen-style tokenizer and tiny Qwen encoders.

Built locally, nothing downloaded (like `dit_demo.py` for SD3 and Flux):

- the **tokenizer** is a `Qwen2Tokenizer` (byte-level BPE, `<|im_start|>` / `<|im_end|>` /
  `<|endoftext|>`) whose merges make each demo caption word, and each word of Qwen-Image's prompt
  template, one token. That matters: `QwenImagePipeline` drops the first 34 tokens of every encoded
  prompt - its system prompt, as Qwen's own tokenizer splits it - and this tokenizer splits it into the
  same 34 tokens (checked when it is built). It carries Qwen3's chat template for Z-Image's pipeline.
  Any other text still tokenizes, byte by byte;
- the **encoders** are Qwen2.5-VL (Qwen-Image) and Qwen3 (Z-Image) at a width of 32, two layers, random
  weights from a fixed seed.
"""
from __future__ import annotations

import torch

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TEXT_WIDTH = 32
"""Hidden size of the tiny encoders (the transformers' `joint_attention_dim` / `cap_feat_dim`)."""

QWEN_IMAGE_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                       "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
                       "{}<|im_end|>\n<|im_start|>assistant\n")
"""`QwenImagePipeline.prompt_template_encode`: each caption is encoded inside it."""
QWEN_IMAGE_DROP = 34
"""`QwenImagePipeline.prompt_template_encode_start_idx`: the template's tokens before the caption."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
"""Qwen3's chat template for plain messages (what `ZImagePipeline` applies, with `enable_thinking=True`)."""

_TEMPLATE_WORDS = ("system", "user", "assistant", "Describe", "the", "image", "by", "detailing", "color", "shape",
                   "size", "texture", "quantity", "text", "spatial", "relationships", "of", "objects", "and",
                   "background")


def demo_qwen_tokenizer(extra_words: tuple[str, ...] = (), extra_specials: tuple[str, ...] = ()):
    """The demo's `Qwen2Tokenizer` (see the module docstring); `extra_words` made one token each too and
    `extra_specials` added as special tokens, after the demo's own (whose tokens stay as they are)."""
    from transformers import Qwen2Tokenizer

    from modules.model.demo import DEMO_WORDS
    from modules.model.tokenizer import bytes_to_unicode

    characters = bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(characters.values())}
    ranks: dict[tuple[str, str], int] = {}
    space = characters[ord(" ")]
    for word in dict.fromkeys(_TEMPLATE_WORDS + DEMO_WORDS + extra_words):
        for form in (word, space + word):  # as a text's first word, and after a space
            # Join the first two pieces the merges so far leave, until the word is one token: a merge
            # added last applies last, so earlier words keep their tokens.
            while len(pieces := bpe_pieces(form, ranks)) > 1:
                ranks[(pieces[0], pieces[1])] = len(ranks)
                vocab.setdefault(pieces[0] + pieces[1], len(vocab))
    for special in (END_OF_TEXT, IM_START, IM_END):
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=sorted(ranks, key=ranks.get), eos_token=IM_END,
                               pad_token=END_OF_TEXT, model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, *extra_specials]})
    tokenizer.chat_template = CHAT_TEMPLATE
    prefix = QWEN_IMAGE_TEMPLATE[:QWEN_IMAGE_TEMPLATE.index("{}")]
    if len(tokenizer(prefix).input_ids) != QWEN_IMAGE_DROP:
        raise RuntimeError(f"the demo tokenizer splits Qwen-Image's prompt template into "
                           f"{len(tokenizer(prefix).input_ids)} tokens, the pipeline drops {QWEN_IMAGE_DROP}; "
                           "update modules/model/families/llm_demo.py")
    return tokenizer


def bpe_pieces(text: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """The pieces BPE with `ranks` makes of `text` (for byte-level BPE, its characters already byte-mapped)."""
    pieces = list(text)
    while len(pieces) > 1:
        candidates = [(ranks[pair], i) for i, pair in enumerate(zip(pieces, pieces[1:])) if pair in ranks]
        if not candidates:
            break
        _, i = min(candidates)
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def tiny_qwen25_vl(tokenizer, seed: int):
    """A tiny random `Qwen2_5_VLForConditionalGeneration` (Qwen-Image's text encoder class)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    ids = _special_ids(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                             "mrope_section": [2, 3, 3]}, **ids),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_WIDTH,
                           fullatt_block_indexes=[0]),
        **ids)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_qwen3(tokenizer, seed: int):
    """A tiny random `Qwen3Model` (Z-Image's text encoder class)."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         **_special_ids(tokenizer))
    return Qwen3Model(config).eval()


def _special_ids(tokenizer) -> dict[str, int]:
    return {"bos_token_id": tokenizer.convert_tokens_to_ids(END_OF_TEXT),
            "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
            "pad_token_id": tokenizer.convert_tokens_to_ids(END_OF_TEXT)}
