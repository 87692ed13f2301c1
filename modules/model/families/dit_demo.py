"""The built-in tiny SD3, Flux and Chroma models (`builtin:demo-sd3`, `builtin:demo-flux`,
`builtin:demo-chroma`), built locally.

Like `builtin:demo` (modules/model/demo.py) they let training, multi-GPU, saving and sampling of the
transformer families run end to end on a CPU in minutes, offline, and show what they learn:

- the **transformer** has the real architecture at a tiny width (random weights, fixed seed);
- the **VAE** is the demo's hand-set thumbnail codec (`demo_vae.py`) with the 16 latent channels of
  the SD3 and Flux VAEs (channels 0-2 carry the colours, the rest are 0) and a `shift_factor`, as theirs;
- the **text encoders** are tiny random CLIP(s) (none for Chroma) and a tiny random T5 encoder;
- the **tokenizers** are made here: the demo's CLIP BPE vocabulary (`demo._demo_bpe`) and a T5-style
  unigram vocabulary of the demo caption words plus single characters (any text tokenizes), so
  nothing is downloaded;
- the **scheduler** is the family's flow-match scheduler (SD3: shift 3; Flux.1-dev and Chroma: shift by
  image size).

Every build is byte-for-byte the same; the folder is written once into `$TANDEM_HOME/demo-sd3` or
`demo-flux` (see `demo.default_demo_root`) and read like any diffusers folder.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

T5_PAD, T5_EOS, T5_UNK = "<pad>", "</s>", "<unk>"
_SEED = 4321
_WIDTH = 64
"""Transformer width (4 heads of 16)."""
_TEXT_WIDTH = 32
"""Width of each tiny CLIP; T5 is twice as wide (SD3 pads both CLIPs side by side to T5's width)."""


def ensure_dit_demo(family: str, root: Path | None = None) -> Path:
    """The `builtin:demo-<family>` folder (`sd3`, `flux`, `chroma`), built on first use, safely from several
    processes."""
    from modules.model.demo import default_demo_root, ensure_built_model

    root = Path(root) if root is not None else default_demo_root(f"demo-{family}")
    return ensure_built_model(root, lambda folder: _build(family, folder))


def _build(family: str, folder: Path) -> None:
    source = folder / "_tokenizer_source"
    clip_tokenizer = _clip_tokenizer(source)
    t5_tokenizer = demo_t5_tokenizer()
    vae = _vae(family)
    builder, clip_folders = _BUILDERS[family]
    builder(clip_tokenizer, t5_tokenizer, vae).save_pretrained(folder, safe_serialization=True)
    # The classic vocab.json + merges.txt beside tokenizer.json, as in the SD demo.
    for tokenizer_folder in clip_folders:
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(source / name, folder / tokenizer_folder / name)
    shutil.rmtree(source)


def _clip_tokenizer(folder: Path):
    from modules.model.demo import _write_and_load_tokenizer

    return _write_and_load_tokenizer(folder)


def demo_t5_tokenizer(max_length: int = 512):
    """A T5-style tokenizer (unigram, `▁` word marks, `</s>` at the end, `<pad>` padding) over the demo
    words and single printable characters; any text tokenizes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    from modules.model.demo import DEMO_WORDS

    characters = [chr(code) for code in range(33, 127)]
    vocab = ([(T5_PAD, 0.0), (T5_EOS, 0.0), (T5_UNK, 0.0)] + [("\u2581" + word, -1.0) for word in DEMO_WORDS]
             + [("\u2581", -2.0)] + [(c, -5.0) for c in characters])
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {T5_EOS}", pair=f"$A {T5_EOS} $B {T5_EOS}", special_tokens=[(T5_EOS, 1)])
    return T5TokenizerFast(tokenizer_object=tokenizer, eos_token=T5_EOS, unk_token=T5_UNK, pad_token=T5_PAD,
                           extra_ids=0, model_max_length=max_length)


def tiny_clip(tokenizer, seed: int, projection: bool):
    """A tiny random CLIP text encoder for `tokenizer` (`projection`: with the pooled projection, as SD3's)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=_TEXT_WIDTH, intermediate_size=2 * _TEXT_WIDTH, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=_TEXT_WIDTH,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def tiny_t5(tokenizer, seed: int):
    """A tiny random T5 encoder for `tokenizer`."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=len(tokenizer), d_model=2 * _TEXT_WIDTH, d_kv=16, d_ff=4 * _TEXT_WIDTH, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        is_encoder_decoder=False, use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5EncoderModel(config).eval()


def _vae(family: str):
    """The demo's thumbnail VAE with 16 latent channels; the colour latents centred and scaled to unit spread."""
    from modules.data.demo_dataset import COLOURS
    from modules.model.demo_vae import build_demo_vae

    palette = torch.tensor(list(COLOURS.values()), dtype=torch.float64) / 127.5 - 1.0
    return build_demo_vae(scaling_factor=round(1.0 / palette.std().item(), 5), latent_channels=16,
                          shift_factor=round(palette.mean().item(), 5))


def _sd3_pipeline(clip_tokenizer, t5_tokenizer, vae):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(_SEED)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=4, attention_head_dim=16,
        num_attention_heads=_WIDTH // 16, joint_attention_dim=2 * _TEXT_WIDTH, caption_projection_dim=_WIDTH,
        pooled_projection_dim=2 * _TEXT_WIDTH, pos_embed_max_size=32, qk_norm="rms_norm", dual_attention_layers=(0,))
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae, text_encoder=tiny_clip(clip_tokenizer, _SEED + 1, True), tokenizer=clip_tokenizer,
        text_encoder_2=tiny_clip(clip_tokenizer, _SEED + 2, True), tokenizer_2=clip_tokenizer,
        text_encoder_3=tiny_t5(t5_tokenizer, _SEED + 3), tokenizer_3=t5_tokenizer)


def _flux_pipeline(clip_tokenizer, t5_tokenizer, vae):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(_SEED)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=_WIDTH // 16, joint_attention_dim=2 * _TEXT_WIDTH, pooled_projection_dim=_TEXT_WIDTH,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    # Flux.1-dev's scheduler: the shift grows with the image's token count (base 256, max 4096 tokens).
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=tiny_clip(clip_tokenizer, _SEED + 1, False), tokenizer=clip_tokenizer,
        text_encoder_2=tiny_t5(t5_tokenizer, _SEED + 3), tokenizer_2=t5_tokenizer, transformer=transformer)


def _chroma_pipeline(clip_tokenizer, t5_tokenizer, vae):
    """Flux.1's tiny layout without CLIP: the T5 encoder alone, and the small modulation approximator."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(_SEED)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=_WIDTH // 16, joint_attention_dim=2 * _TEXT_WIDTH, axes_dims_rope=(4, 6, 6),
        approximator_num_channels=16, approximator_hidden_dim=2 * _TEXT_WIDTH, approximator_layers=2)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    return ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=tiny_t5(t5_tokenizer, _SEED + 3),
                          tokenizer=t5_tokenizer, transformer=transformer)


_BUILDERS = {"sd3": (_sd3_pipeline, ("tokenizer", "tokenizer_2")), "flux": (_flux_pipeline, ("tokenizer",)),
             "chroma": (_chroma_pipeline, ())}
"""Each family's tiny pipeline and its folders of CLIP tokenizers (which get vocab.json + merges.txt)."""


# ------------------------------------------------------------------ Flux.2

_FLUX2_SPECIAL = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                  "<|im_start|>", "<|im_end|>", "<think>", "</think>")
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set text = message['content'] if message['content'] is string else message['content'][0]['text'] %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{{ text }}[/INST]{% endif %}{% endfor %}")
"""Mistral-Small's chat layout, reduced to what Flux2Pipeline sends: a system message and a user message."""
_QWEN3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant "
    "{% if enable_thinking is defined and enable_thinking is false %}<think> </think> {% endif %}{% endif %}")
"""Qwen3's chat layout, reduced to what Flux2KleinPipeline sends (a user message, no thinking)."""
_FLUX2_TEXT_LAYERS = {True: 30, False: 27}
"""Language-model depth of the tiny Flux.2 text encoders: the pipelines read hidden layers 10/20/30 (dev)
and 9/18/27 (Klein), so the tiny models are as deep, only narrow."""


def flux2_tokenizer(dev: bool):
    """A word-level tokenizer over the demo words (other words become `<unk>`) with the chat template of
    Flux.2-dev's Mistral (`dev`) or Klein's Qwen3, and their special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from modules.model.demo import DEMO_WORDS

    vocab = {token: index for index, token in enumerate(_FLUX2_SPECIAL)}
    for word in ["\u2581" + w for w in DEMO_WORDS] + ["\u2581"]:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=512,
                                   chat_template=_MISTRAL_TEMPLATE if dev else _QWEN3_TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": list(_FLUX2_SPECIAL[4:])})
    return fast


def flux2_text_encoder(dev: bool, seed: int = _SEED + 5):
    """(a tiny random language model, its tokenizer): Mistral3 (vision tower included, as Flux.2-dev's) or
    Qwen3 (Klein's), each 32 wide with three hidden layers read side by side (96 values per token)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = flux2_tokenizer(dev)
    text = dict(vocab_size=len(tokenizer), hidden_size=_TEXT_WIDTH, intermediate_size=2 * _TEXT_WIDTH,
                num_hidden_layers=_FLUX2_TEXT_LAYERS[dev], num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = _mistral3(text, tokenizer) if dev else Qwen3ForCausalLM(Qwen3Config(**text, tie_word_embeddings=True))
    return damped_residuals(model).eval(), tokenizer


def damped_residuals(model):
    """`model` (a deep tiny random language model) with each layer's residual branches (attention and MLP
    outputs) a tenth of their random size. A deep random transformer blurs its tokens together layer by layer,
    and the Flux.2 and Flux.3 pipelines read layers up to 30 or 32 deep: damped, the words stay apart in every
    layer read, and the captions' colours and shapes reach the denoiser."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                parameter.mul_(0.1)
    return model


def _mistral3(text: dict, tokenizer):
    """A tiny Mistral3 with its (tiny) vision tower, as Flux.2-dev's text encoder is built."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config={"model_type": "mistral", **text},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 64, "patch_size": 16},
        image_token_index=tokenizer.unk_token_id, spatial_merge_size=2, vision_feature_layer=-1)
    return Mistral3ForConditionalGeneration(config)


def _flux2_vae():
    """The thumbnail VAE with Flux.2's 32 latent channels and batch-norm statistics over 2x2 patches that
    give the colour latents unit spread around 0 (patch channel 4c + 2dy + dx holds latent channel c)."""
    from modules.data.demo_dataset import COLOURS
    from modules.model.demo_vae import build_demo_vae

    palette = torch.tensor(list(COLOURS.values()), dtype=torch.float64) / 127.5 - 1.0
    vae = build_demo_vae(latent_channels=32, vae_class="AutoencoderKLFlux2")
    colours = 4 * 3  # the three colour latents, each in its four patch positions
    with torch.no_grad():
        vae.bn.running_mean.zero_()[:colours] = round(palette.mean().item(), 5)
        vae.bn.running_var.fill_(1.0)[:colours] = round(palette.var().item(), 5)
    return vae


def _flux2_pipeline(clip_tokenizer, t5_tokenizer, vae, dev: bool = True):
    """Flux.2-dev's layout (`dev`: guidance input, Mistral3) or Klein's (Qwen3), tiny; `vae` is unused (Flux.2
    has its own)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel

    encoder, tokenizer = flux2_text_encoder(dev)
    torch.manual_seed(_SEED)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=_WIDTH // 16, joint_attention_dim=3 * _TEXT_WIDTH, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=dev)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    parts = dict(scheduler=scheduler, vae=_flux2_vae(), text_encoder=encoder, tokenizer=tokenizer,
                 transformer=transformer)
    return Flux2Pipeline(**parts) if dev else Flux2KleinPipeline(**parts, is_distilled=False)


_BUILDERS["flux2"] = (_flux2_pipeline, ())
_BUILDERS["flux2-klein"] = (lambda clip, t5, vae: _flux2_pipeline(clip, t5, vae, dev=False), ())
