"""Qwen-Image 2.1: a 7 B single-stream, block-causal transformer on unpatched 16x latents, Qwen3-VL 8B as text
encoder, rectified flow.

What it shares with Qwen-Image (`qwen_image.py`, which this module extends) - a Qwen-VL text encoder loaded apart,
the text side cached with masks, a Wan-type VAE whose image is one frame normalised per channel, true CFG with " "
as the default negative prompt, single files in diffusers' names - and everything else as diffusers'
`QwenImage21Pipeline` does it:

- **Text**: each caption inside 2.1's template (system prompt "Comprehend and analyze the provided prompt."),
  tokenized as one string with left padding, through Qwen3-VL's language model; the *last decoder layer's* output
  before the final norm (the pipeline strips that norm with a hook), each caption's tokens after the system turn
  (the caption and the closing turn tokens), not truncated (the pipeline has no limit), with a mask.
- **Latents**: its own VAE (`AutoencoderKLQwenImage21`, Wan 2.2's kind): 64 channels at 1/16 of the image, read as
  RGBA (Tandem's images go in opaque) and normalised per channel by `latents_mean` / `latents_std`. The
  transformer takes them unpatched, one token per latent pixel in raster order; its image slots stand for 2x2
  groups of tokens, so both sides must be even: images are multiples of 32 px.
- **Transformer**: one sequence - the caption's tokens, then the image's (`img_mask` marks one slot per 2x2 group);
  attention causal over the caption and bidirectional inside the image; the caption modulated at t = 0
  (`causal_condition`), the image at its t in [0, 1]. Its output covers the whole sequence: the image's part is
  the velocity.
- **Timesteps**: logit-normal t shifted by the image's token count (H x W latent pixels) as the scheduler shifts it
  when sampling (mu from 0.5 at 256 tokens to 0.9 at 8192).
- **Sampling**: the pipeline with the cached embeddings; `sample_sigmas` from the model's `model_index.json` (the
  Turbo's few-step grid - it then decides the number of steps; the base has none); true CFG above a scale of 1.

Single files are ComfyUI's layout of the release (`qwen_image_2.1_bf16.safetensors`): diffusers' names with each
block's SwiGLU gate and up projections fused in `img_mlp.gate_up` (gate rows first), `model.diffusion_model.` in
front or not - diffusers' `convert_qwen_image21_transformer_checkpoint_to_diffusers` reads them. Kohya LoRA files
use those names (`lora_unet_transformer_blocks_0_attn_to_q`), which ComfyUI applies; see docs/Models.md.
"""
from __future__ import annotations

import json

import torch
from transformers import ProcessorMixin

from modules.model.text_apart import HIDDEN, MASK, masked_rows, output_of, padded, trimmed

from . import original_layout as layout
from .flow_base import FlowMatching
from .llm_flow import identity_entries
from .qwen_image import QwenImageFamily

IMPLEMENTATION = "https://github.com/QwenLM/Qwen-Image"
SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
"""`QwenImage21Pipeline.sys_prompt`."""
SYSTEM_TURN = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
"""The template's system turn: its tokens are dropped from the encoder's output (the pipeline's `_drop_idx`)."""
TEMPLATE = SYSTEM_TURN + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
"""`QwenImage21Pipeline.prompt_template_t2i`: each caption is encoded inside it."""
SLOT = 4
"""Latent tokens per image slot of the transformer's `img_mask` (a 2x2 group)."""


class QwenImage21Objective(FlowMatching):
    def image_tokens(self, latent_shape):
        """One token per latent pixel (the latents go in unpatched): the count the pipeline shifts by."""
        return latent_shape[-2] * latent_shape[-1]

    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None):
        batch, channels, height, width = noisy.shape
        hidden, mask, _ = trimmed(text)
        image_tokens = height * width
        # The caption's positions hold no image; one slot per 2x2 group of the image's tokens follows them.
        slots = torch.cat([torch.zeros(batch, hidden.shape[1], dtype=torch.bool, device=noisy.device),
                           torch.ones(batch, image_tokens // SLOT, dtype=torch.bool, device=noisy.device)], dim=1)
        out = denoiser(hidden_states=noisy.flatten(2).transpose(1, 2), encoder_hidden_states=hidden,
                       encoder_hidden_states_mask=mask, timestep=timesteps, img_shapes=[[(1, height, width)]] * batch,
                       img_mask=slots, return_dict=False)[0]
        return out[:, -image_tokens:].transpose(1, 2).reshape(batch, channels, height, width)


class TokenizerProcessor(ProcessorMixin):
    """What `QwenImage21Pipeline` asks of its `Qwen3VLProcessor` for text-to-image, without one: a `Qwen3VLProcessor`
    needs its video processor, which needs torchvision, which Tandem does not depend on. A transformers processor
    (diffusers takes no other) of the tokenizer alone; the chat template is Qwen's (ChatML) for text messages."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)

    def __call__(self, text, **kwargs):
        return self.tokenizer(text, **kwargs)

    def apply_chat_template(self, conversation, tokenize=True, **kwargs):
        """The conversation (one list of messages, text parts only) as ChatML, tokenized: a batch of one."""
        rendered = "".join(f"<|im_start|>{message['role']}\n{_text_of(message['content'])}<|im_end|>\n"
                           for message in conversation)
        return [self.tokenizer(rendered).input_ids] if tokenize else [rendered]


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if any(part.get("type") != "text" for part in content):
        raise ValueError("Tandem samples Qwen-Image 2.1 from text alone; a message with an image part needs "
                         "transformers' Qwen3VLProcessor (with torchvision)")
    return "".join(part["text"] for part in content)


class QwenImage21Family(QwenImageFamily):
    transformer_class = "QwenImage21Transformer2DModel"
    vae_class = "AutoencoderKLQwenImage21"
    tokenizer_folder = "processor"
    kohya_version = "qwen_image21"
    kohya_implementation = IMPLEMENTATION
    modelspec_name = "qwen-image-2.1"

    # ------------------------------------------------------------------ loading

    def _assemble(self, transformer, folder, model_cfg, dtypes, source_name, own_vae):
        """Qwen-Image's bundle, with the folder's sampling grid (`sample_sigmas` in `model_index.json`: the Turbo's)."""
        bundle = super()._assemble(transformer, folder, model_cfg, dtypes, source_name, own_vae)
        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
        bundle.extra["sample_sigmas"] = index.get("sample_sigmas")
        return bundle

    def latent_scale(self, variant=""):
        return 16

    # ------------------------------------------------------------------ text

    def encode_with(self, encoder, tokenizer, captions, device):
        # The pipeline's: an empty caption becomes " " (Qwen has no start token, so "" would leave nothing to read).
        texts = [TEMPLATE.format(caption or " ") for caption in captions]
        tokens = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        # The last decoder layer's output, before the final norm (the pipeline's `hidden_states[-1]`, norm hooked out).
        hidden = output_of(self.text_encoder_layers(encoder)[-1], lambda: encoder(input_ids=ids, attention_mask=mask))
        drop = len(tokenizer(SYSTEM_TURN).input_ids)
        return padded([row[drop:] for row in masked_rows(hidden, mask)])

    def write_tokenizer(self, side, folder):
        """The processor's folder: copied from where the model was loaded (the tokenizer and the image and video
        processors' configs), or the tokenizer with Qwen3-VL's processor configs for a model that has none."""
        from .llm_flow import copy_component
        from .qwen_image21_demo import write_processor_folder

        source = side.folder / "processor"
        if (source / "tokenizer_config.json").is_file():
            copy_component(source, folder / "processor")
        else:
            write_processor_folder(side.tokenizer, folder / "processor")
        return {"processor": ["transformers", "Qwen3VLProcessor"]}

    def random_model_tokenizer(self):
        from .qwen_image21_demo import demo_qwen3vl_tokenizer

        return demo_qwen3vl_tokenizer()

    # ------------------------------------------------------------------ training, sampling

    def objective(self, bundle, training_cfg=None):
        return QwenImage21Objective(bundle, training_cfg)

    def unused_denoiser_parts(self, bundle):
        """None: a single stream, every weight serves the image's tokens too."""
        return []

    def pipeline(self, bundle):
        from diffusers import QwenImage21Pipeline

        side = bundle.extra.get("text_side")
        tokenizer = side.tokenizer if side is not None else self.random_model_tokenizer()
        return QwenImage21Pipeline(scheduler=self.sampling_scheduler(bundle), vae=bundle.vae, text_encoder=None,
                                   processor=TokenizerProcessor(tokenizer), transformer=bundle.denoiser,
                                   sample_sigmas=bundle.extra.get("sample_sigmas"))

    def stock_pipeline(self, folder):
        """`QwenImage21Pipeline.from_pretrained(folder)` with the processor's tokenizer standing in for the processor
        (`TokenizerProcessor`: a `Qwen3VLProcessor` needs torchvision)."""
        from diffusers import QwenImage21Pipeline
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, subfolder=self.tokenizer_folder, local_files_only=True)
        return QwenImage21Pipeline.from_pretrained(folder, processor=TokenizerProcessor(tokenizer),
                                                   local_files_only=True)

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        arguments = super().pipeline_arguments(bundle, prompt, guidance_scale)
        del arguments["max_sequence_length"]  # 2.1's pipeline has no limit
        return arguments

    def model_index_extras(self, bundle):
        """The sampling grid the model came with (`sample_sigmas`: the Turbo's), kept in a saved folder."""
        return {"sample_sigmas": bundle.extra.get("sample_sigmas")}

    def cached_shapes(self):
        """64 latent channels; 256 text tokens of Qwen3-VL 8B's 4096 features, and their mask."""
        return 64, {HIDDEN: (256, 4096), MASK: (256,)}

    def build_demo(self, root=None):
        from .qwen_image21_demo import ensure_qwen_image21_demo

        return ensure_qwen_image21_demo(root)

    # ------------------------------------------------------------------ single files

    def layout(self, config, keys):
        """Diffusers' names, each block's `img_mlp.gate_layer` and `img_mlp.proj` fused in `img_mlp.gate_up`."""
        entries = []
        for entry in identity_entries(keys):
            if entry.original.endswith(".img_mlp.proj"):
                continue
            if entry.original.endswith(".img_mlp.gate_layer"):
                stem = entry.original.removesuffix(".gate_layer")
                entry = layout.Entry(f"{stem}.gate_up", (f"{stem}.gate_layer", f"{stem}.proj"), params=entry.params)
            entries.append(entry)
        return entries

    def file_sizes(self, state, inner):
        """Its output channels (no patches), text width and SwiGLU ratio (from the fused `gate_up`)."""
        return {"out_channels": state["proj_out.weight"].shape[0],
                "context_in_dim": state["txt_in.in_layer.weight"].shape[1],
                "mlp_ratio": state["transformer_blocks.0.img_mlp.gate_up.weight"].shape[0] // (2 * inner)}
