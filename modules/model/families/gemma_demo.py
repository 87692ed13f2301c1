"""A Gemma-style tokenizer and a tiny Gemma 2 encoder, made here: the text side of the built-in Lumina 2 model
(`lumina2_demo.py`) and the `gemma` text-encoder kind's tiny builder (benchmarks, `text_encoders.py`).

Nothing is downloaded. The tokenizer is transformers' own `GemmaTokenizer` class (byte-level BPE with byte
fallback, spaces as `▁`, `<bos>` in front, `<pad>` padding) over a vocabulary whose merges make each demo
caption word and each word of Lumina 2's system prompt one token - so the prompt template the pipeline puts
before every caption costs a few dozen tokens, as with Gemma's real vocabulary. Any other text still
tokenizes, byte by byte. The encoder is a `Gemma2Model` at a width of 32, two layers, random weights from a seed.
"""
from __future__ import annotations

import torch

from modules.model.families.llm_demo import bpe_pieces

TEXT_WIDTH = 32
"""Hidden size of the tiny encoder (the transformer's `cap_feat_dim`)."""
PAD, EOS, BOS, UNK, MASK = "<pad>", "<eos>", "<bos>", "<unk>", "<mask>"
SPACE = "\u2581"
"""How Gemma's tokenizer writes a space."""

_PROMPT_WORDS = ("You", "are", "an", "assistant", "designed", "to", "generate", "superior", "images", "with", "the",
                 "degree", "of", "image-text", "alignment", "based", "on", "textual", "prompts", "or", "user",
                 "<Prompt", "Start>")
"""The words of `Lumina2Pipeline`'s system prompt and its `<Prompt Start>` mark."""


def demo_gemma_tokenizer():
    """The demo's `GemmaTokenizer` (see the module docstring)."""
    from transformers import GemmaTokenizer

    from modules.model.demo import DEMO_WORDS

    vocab = {token: i for i, token in enumerate((PAD, EOS, BOS, UNK, MASK))}
    for byte in range(256):  # byte fallback: any character tokenizes
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    words = list(dict.fromkeys(_PROMPT_WORDS + DEMO_WORDS))
    for character in sorted({c for word in words for c in word} | {SPACE, "."}):
        vocab.setdefault(character, len(vocab))
    ranks: dict[tuple[str, str], int] = {}
    for word in words:
        for form in (word, SPACE + word):  # a text's first word, and one after a space
            # Join the first two pieces the merges so far leave, until the form is one token: a merge added
            # last applies last, so the forms made earlier keep their tokens.
            while len(pieces := bpe_pieces(form, ranks)) > 1:
                ranks[(pieces[0], pieces[1])] = len(ranks)
                vocab.setdefault(pieces[0] + pieces[1], len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=sorted(ranks, key=ranks.get), unk_token=UNK, bos_token=BOS,
                          eos_token=EOS, pad_token=PAD, mask_token=MASK, add_bos_token=True, add_eos_token=False,
                          model_max_length=8192)


def tiny_gemma2(tokenizer, seed: int):
    """A tiny random `Gemma2Model` (Lumina 2's text encoder class) over `tokenizer`'s vocabulary."""
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    ids = {name: tokenizer.convert_tokens_to_ids(token)
           for name, token in (("pad_token_id", PAD), ("eos_token_id", EOS), ("bos_token_id", BOS))}
    if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids.values()):
        ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
               "bos_token_id": tokenizer.bos_token_id or tokenizer.eos_token_id}
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          query_pre_attn_scalar=16, max_position_embeddings=2048, sliding_window=512, **ids)
    model = Gemma2Model(config).eval()
    # Gemma normalises each layer's attention and MLP outputs before adding them; beside those, embeddings at
    # transformers' initial scale (std 0.02, times sqrt(width)) would leave a word's own embedding a tenth of its
    # hidden state, the rest the same mix of the system prompt for every caption - the demo's captions would barely
    # differ. Unit-variance embeddings keep each word's identity, as a trained model's do.
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0.0, 1.0)
    return model
