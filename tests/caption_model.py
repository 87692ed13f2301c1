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


def build_tiny_llava(folder: Path) -> Path:
    """A tiny random LLaVA (CLIP vision tower, Llama text model) with a chat template: the path chat models
    (Qwen2-VL and the like) take - asked through the template, the prompt cut from the answer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
                              PreTrainedTokenizerFast)

    folder.mkdir(parents=True, exist_ok=True)
    words = WORDS + "describe this image in one or two sentences . USER: ASSISTANT:".split()
    vocab = {word: i for i, word in enumerate(["<pad>", "<s>", "</s>", "<image>", "[UNK]"] + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>", additional_special_tokens=["<image>"])
    template = ("{% for m in messages %}{{ m['role'].upper() }}: {% for c in m['content'] %}"
                "{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
                "{% if add_generation_prompt %}ASSISTANT: {% endif %}")
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 28},
                                                                  crop_size={"height": 28, "width": 28}),
                               tokenizer=tokenizer, chat_template=template, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=16),
        text_config=dict(model_type="llama", vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        image_token_id=vocab["<image>"], vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
