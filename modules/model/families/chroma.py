"""Chroma (8.9B): Flux.1's double/single-stream layout without CLIP or guidance input, T5-XXL with masks.

- **Text**: T5-XXL alone (512 tokens, as `ChromaPipeline` is called), encoded with the tokenizer's
  attention mask. The transformer sees the text through a mask too: every real token and the first
  padding token, the rest hidden - as Chroma was trained (lodestone-rock/flow) and as ComfyUI runs it.
  diffusers' `ChromaPipeline` builds that mask as floats, which `scaled_dot_product_attention` adds to
  the scores instead of masking with them (diffusers issue #12116); so Tandem trains with the boolean
  mask and renders samples by handing the pipeline its own embeddings and boolean masks.
- **Modulation**: no per-block modulation layers; one "distilled guidance" approximator turns the
  timestep into every block's shift/scale/gate (`distilled_guidance_layer`). No pooled text, no guidance
  input: samples use true classifier-free guidance with a negative prompt (`sampling.guidance_scale`).
- **Latents, packing, timesteps**: as Flux.1-dev - 16-channel latents packed 2x2 into 64-value tokens
  (16 px image-size step), t in [0, 1] shifted by image size (`use_dynamic_shifting`).

Single files are in Chroma's release layout (`Chroma1-HD.safetensors`: Black Forest Labs' names as in
Flux.1 - `double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1` - plus `distilled_guidance_layer.*`),
and so are kohya LoRA names (`lora_unet_double_blocks_0_img_attn_qkv`), which ComfyUI applies to its
Chroma model (a Flux model there); see docs/Models.md.
"""
from __future__ import annotations

from typing import Sequence

import torch

from modules.model.lora_metadata import IMPLEMENTATION_CHROMA
from modules.model.sample_texts import sample_text

from . import original_layout as layout
from .flow_base import FlowFamily, FlowMatching, _device_of, _dtype_of, shipped
from .flux import bfl_widths, count_blocks, flux_entries, image_ids, pack_latents, unpack_latents

MASK = "attention_mask"
"""The text tensor that says which T5 tokens the transformer sees (bool [B, tokens])."""


def transformer_text_mask(tokenizer_mask: torch.Tensor) -> torch.Tensor:
    """The transformer's text mask from the tokenizer's: the real tokens and the first padding token
    (Chroma's convention: the first `</s>`-like pad carries the end of the prompt), as booleans."""
    lengths = tokenizer_mask.sum(dim=1, keepdim=True)
    positions = torch.arange(tokenizer_mask.shape[1], device=tokenizer_mask.device)[None, :]
    return positions <= lengths


class ChromaObjective(FlowMatching):
    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None):
        """The transformer sees the text up to the batch's longest caption (and its first pad), and a mask only
        where captions are shorter than that. Exact: no query attends to a hidden token, and text positions
        are all 0, so cutting the hidden tail off changes nothing - except that a batch whose captions fill
        the same length attends without a mask (flash attention) over far fewer tokens than 512. Costs one
        wait for the GPU per call (the caption lengths)."""
        batch, _, height, width = noisy.shape
        keep = text[MASK].to(torch.bool)
        # Shape-only (meta) tensors hold no lengths: every token is kept.
        lengths = [keep.shape[1]] * batch if keep.is_meta else keep.sum(dim=1).tolist()
        longest = max(1, int(max(lengths)))
        hidden = text["encoder_hidden_states"][:, :longest]
        mask = None
        if min(lengths) < longest:
            image_tokens = (height // 2) * (width // 2)
            mask = torch.cat([keep[:, :longest].to(noisy.device),
                              torch.ones(batch, image_tokens, device=noisy.device, dtype=torch.bool)], dim=1)
        out = denoiser(
            hidden_states=pack_latents(noisy), timestep=timesteps, encoder_hidden_states=hidden,
            txt_ids=torch.zeros(hidden.shape[1], 3, device=noisy.device, dtype=noisy.dtype),
            img_ids=image_ids(height, width, noisy.device, noisy.dtype), attention_mask=mask, return_dict=False)[0]
        return unpack_latents(out, height, width)


class ChromaFamily(FlowFamily):
    transformer_class = "ChromaTransformer2DModel"
    clip_classes = ()
    default_t5_length = 512
    file_prefix = ""
    kohya_version = "chroma"
    kohya_implementation = IMPLEMENTATION_CHROMA

    def modelspec_architecture(self, bundle) -> str:
        return "chroma"  # sd-scripts' name (ARCH_FLUX_1_CHROMA)

    # ------------------------------------------------------------------ text

    def encode_text(self, bundle, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """`encoder_hidden_states` [B, T5 length, T5 width] (T5 run with the tokenizer's mask) and
        `attention_mask` [B, T5 length] (bool: the tokens the transformer attends to)."""
        t5 = bundle.text_encoders[0]
        tokens = bundle.tokenizers[0](list(captions), padding="max_length", max_length=bundle.text_lengths()[0],
                                      truncation=True, return_tensors="pt")
        device = _device_of(t5)
        tokenizer_mask = tokens.attention_mask.to(device)
        hidden = t5(tokens.input_ids.to(device), attention_mask=tokenizer_mask)[0].to(dtype=_dtype_of(t5))
        return {"encoder_hidden_states": hidden, MASK: transformer_text_mask(tokenizer_mask)}

    # ------------------------------------------------------------------ training, sampling

    def objective(self, bundle, training_cfg=None):
        return ChromaObjective(bundle, training_cfg)

    def pipeline(self, bundle):
        from diffusers import ChromaPipeline

        return ChromaPipeline(scheduler=self.sampling_scheduler(bundle), vae=bundle.vae,
                              text_encoder=bundle.text_encoders[0], tokenizer=bundle.tokenizers[0],
                              transformer=bundle.denoiser)

    samples_from_embeddings = True

    def texts_for_samples(self, prompts, guidance_scale):
        """The prompts and their negative prompts ("" where none): the pipeline gets both's embeddings."""
        return list(dict.fromkeys([prompt.prompt for prompt in prompts] +
                                  [prompt.negative_prompt or "" for prompt in prompts]))

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        """The prompt's and the negative prompt's embeddings with boolean masks (see the module's note)."""
        positive = sample_text(bundle, prompt.prompt)
        negative = sample_text(bundle, prompt.negative_prompt or "")
        return {"prompt_embeds": positive["encoder_hidden_states"], "prompt_attention_mask": positive[MASK],
                "negative_prompt_embeds": negative["encoder_hidden_states"],
                "negative_prompt_attention_mask": negative[MASK], "guidance_scale": guidance_scale,
                "max_sequence_length": bundle.text_lengths()[0]}

    def model_index_extras(self, bundle):
        return {"image_encoder": [None, None], "feature_extractor": [None, None]}

    def cached_shapes(self):
        """512 T5-XXL tokens and their mask."""
        return 16, {"encoder_hidden_states": (512, 4096), MASK: (512,)}

    def build_demo(self, root=None):
        from .dit_demo import ensure_dit_demo

        return ensure_dit_demo("chroma", root)

    # ------------------------------------------------------------------ single files

    def layout(self, config, keys):
        return layout.keep_present(chroma_entries(config["num_layers"], config["num_single_layers"],
                                                  config["approximator_layers"]), keys)

    def shipped_transformer_config(self, state):
        """Chroma1-HD's config, with the block counts and widths a file's tensors show (`state` may be empty)."""
        config = shipped("chroma", "transformer")
        if not state:
            return config
        hidden, channels = state["distilled_guidance_layer.in_proj.weight"].shape
        return {**config, **bfl_widths(state, config), "approximator_num_channels": channels,
                "approximator_hidden_dim": hidden,
                "approximator_layers": count_blocks(state, r"distilled_guidance_layer\.layers\.(\d+)\.")}

    def owns_key(self, key):
        return not key.startswith(("vae.", "first_stage_model.", "text_encoders."))


def chroma_entries(num_layers: int, num_single_layers: int, approximator_layers: int) -> list[layout.Entry]:
    """Every module of a Chroma transformer, diffusers <-> release names (the reverse of diffusers'
    `convert_chroma_transformer_checkpoint_to_diffusers`): Flux.1's table, whose modulation and
    guidance rows `keep_present` drops, plus the approximator."""
    E = layout.Entry
    entries = flux_entries(num_layers, num_single_layers)
    entries += [E("distilled_guidance_layer.in_proj", ("distilled_guidance_layer.in_proj",)),
                E("distilled_guidance_layer.out_proj", ("distilled_guidance_layer.out_proj",))]
    for i in range(approximator_layers):
        o = f"distilled_guidance_layer.layers.{i}"
        entries += [E(f"{o}.in_layer", (f"{o}.linear_1",)), E(f"{o}.out_layer", (f"{o}.linear_2",)),
                    E(f"distilled_guidance_layer.norms.{i}", (f"distilled_guidance_layer.norms.{i}",),
                      params=(("scale", "weight"),))]
    return entries
