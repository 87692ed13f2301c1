"""A tiny random BLIP captioning model built offline (a word-piece vocabulary written here, no download), of
the class a real BLIP folder loads as, for the auto-caption tests."""
from __future__ import annotations

from pathlib import Path

WORDS = "a an the cat dog red blue sits on mat photo of".split()


def build_tiny_blip(folder: Path) -> Path:
    import torch
    from transformers import (BertTokenizer, BlipConfig, BlipForConditionalGeneration, BlipImageProcessor,
                              BlipProcessor)

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    tokenizer = BertTokenizer(vocab=str(folder / "vocab.txt"), do_lower_case=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    processor = BlipProcessor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}),
                              tokenizer=tokenizer)
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = BlipConfig(vision_config=dict(small, image_size=32, patch_size=16), projection_dim=16,
                        text_config=dict(small, vocab_size=len(tokenizer), max_position_embeddings=64,
                                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                                         sep_token_id=tokenizer.sep_token_id, eos_token_id=tokenizer.sep_token_id))
    torch.manual_seed(0)
    model = BlipForConditionalGeneration(config)
    with torch.no_grad():  # random weights would mostly emit special tokens: lean towards real words
        bias = model.text_decoder.cls.predictions.bias
        bias[tokenizer.convert_tokens_to_ids(["cat", "sits", "mat"])] += 8.0
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
