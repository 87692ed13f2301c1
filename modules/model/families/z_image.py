"""Z-Image (base and Turbo): a 6 B single-stream transformer, Qwen3 4B as text encoder, rectified flow.

Everything follows diffusers' `ZImagePipeline`:

- **Text**: each caption as a user message through Qwen3's chat template (`enable_thinking=True`), the
  second-to-last layer's hidden states of its own tokens (at most 512), with a mask (`text_apart.py`). The
  text encoder is loaded apart (`llm_flow.py`): only to fill the text cache, before the transformer.
- **Latents**: Flux.1's VAE (16 channels at 1/8, shift and scale as its config says), 2x2 patches inside
  the transformer, so image sides are multiples of 16 px.
- **Transformer**: a list of samples, each [C, 1, H, W] with its own caption [L, D] (no padding between
  samples); its time input runs the other way (1 - t: 1 is the clean image) and its output is the
  negative velocity, which the pipeline negates - so does `ZImageObjective.predict`.
- **Timesteps**: logit-normal t shifted as the scheduler shifts it (Z-Image-Turbo's: a fixed 3, no
  dynamic shifting; a folder's own scheduler config decides).
- **Sampling**: classifier-free guidance when `sampling.guidance_scale` > 0 (Turbo is distilled: 0 and 8
  steps; base: about 4 and 28-50 steps), the negative prompt "" when none is given.

Single files are in the original release layout (ComfyUI's `z_image_turbo_bf16.safetensors`: q, k, v fused
in `attention.qkv`, `attention.out`, `q_norm`/`k_norm`, `x_embedder` / `final_layer` without diffusers'
`all_..._2-1` wrappers). The kohya LoRA layout uses those names (`lora_unet_layers_0_attention_qkv`), which
ComfyUI and diffusers both read; see docs/Models.md.
"""
from __future__ import annotations

import torch

from modules.model.text_apart import HIDDEN, MASK, masked_rows, output_of, padded, trimmed

from . import original_layout as layout
from .flow_base import FlowMatching, shipped
from .llm_flow import MAX_TEXT_TOKENS, NEXT_DIT_PARTS, LLMFlowFamily, block_count

IMPLEMENTATION = "https://github.com/Tongyi-MAI/Z-Image"


class ZImageObjective(FlowMatching):
    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None):
        hidden, _, lengths = trimmed(text)  # each caption's own tokens: they come first in its row
        out = denoiser(list(noisy.unsqueeze(2).unbind(0)), 1 - timesteps,
                       [row[:length] for row, length in zip(hidden, lengths)], return_dict=False)[0]
        return -torch.stack(out).squeeze(2)


class ZImageFamily(LLMFlowFamily):
    transformer_class = "ZImageTransformer2DModel"
    vae_class = "AutoencoderKL"
    file_prefix = ""
    kohya_version = "z_image"
    kohya_implementation = IMPLEMENTATION
    modelspec_name = "z-image"

    # ------------------------------------------------------------------ text

    def encode_with(self, encoder, tokenizer, captions, device):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=True)
                 for caption in captions]
        tokens = tokenizer(texts, padding=True, max_length=MAX_TEXT_TOKENS, truncation=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        # The pipeline's hidden_states[-2]: what the second-to-last layer gives.
        hidden = output_of(self.text_encoder_layers(encoder)[-2],
                           lambda: encoder(input_ids=ids, attention_mask=mask.bool()))
        return padded(masked_rows(hidden, mask))

    def unused_denoiser_parts(self, bundle):
        """The padding embeddings: the image's (`x_pad_token`) serves only sizes whose token count is no multiple
        of 32 (never at 1024 px), the caption's only captions of such lengths - so some steps, and some ranks of a
        step, give them no gradient, which DDP cannot take. A full fine-tune keeps them as they are."""
        denoiser = bundle.denoiser
        return [token for token in (getattr(denoiser, "x_pad_token", None), getattr(denoiser, "cap_pad_token", None))
                if token is not None]

    # ------------------------------------------------------------------ training, sampling

    def objective(self, bundle, training_cfg=None):
        return ZImageObjective(bundle, training_cfg)

    def pipeline(self, bundle):
        from diffusers import ZImagePipeline

        side = bundle.extra.get("text_side")
        return ZImagePipeline(scheduler=self.sampling_scheduler(bundle), vae=bundle.vae, text_encoder=None,
                              tokenizer=side.tokenizer if side is not None else None, transformer=bundle.denoiser)

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        arguments = {"prompt_embeds": self._caption(bundle, prompt.prompt), "guidance_scale": guidance_scale,
                     "max_sequence_length": MAX_TEXT_TOKENS}
        if self.guides(guidance_scale):
            arguments["negative_prompt_embeds"] = self._caption(bundle, self.negative_prompt(prompt))
        return arguments

    def guides(self, guidance_scale: float) -> bool:
        """`ZImagePipeline` guides at any scale above 0 (Turbo samples with 0)."""
        return guidance_scale > 0

    def _caption(self, bundle, text: str) -> list[torch.Tensor]:
        """The pipeline's `prompt_embeds` for one prompt: a list of one [L, D] tensor."""
        hidden, mask = self.prompt_embeddings(bundle, text)
        return masked_rows(hidden, mask)

    def cached_shapes(self):
        """256 text tokens (the raw reference's) of Qwen3 4B's 2560 features, and their mask."""
        return 16, {HIDDEN: (256, 2560), MASK: (256,)}

    def build_demo(self, root=None):
        from .llm_demo_models import ensure_llm_demo

        return ensure_llm_demo("zimage", root)

    # ------------------------------------------------------------------ single files

    def layout(self, config, keys):
        return zimage_entries(keys)

    other_parts = NEXT_DIT_PARTS

    def shipped_transformer_config(self, state):
        """Z-Image's config, with the sizes a file's weights show (depths, width, heads, caption features)."""
        config = shipped("zimage", "transformer")
        if not state:
            return config
        dim = state["cap_pad_token"].shape[-1]
        head_dim = state["layers.0.attention.q_norm.weight"].shape[0]
        return {**config, "dim": dim, "n_heads": dim // head_dim, "n_kv_heads": dim // head_dim,
                "n_layers": block_count(state, r"layers\.(\d+)\."),
                "n_refiner_layers": block_count(state, r"noise_refiner\.(\d+)\."),
                "cap_feat_dim": state["cap_embedder.1.weight"].shape[1],
                "in_channels": state["x_embedder.weight"].shape[1] // 4}


_RENAMES = ((".attention.to_out.0", ".attention.out"), (".attention.norm_q", ".attention.q_norm"),
            (".attention.norm_k", ".attention.k_norm"))
_TOP_RENAMES = (("all_x_embedder.2-1", "x_embedder"), ("all_final_layer.2-1.", "final_layer."))


def zimage_entries(keys) -> list[layout.Entry]:
    """Every module of a Z-Image transformer with these (diffusers) weights, diffusers <-> original names (the
    reverse of diffusers' `convert_z_image_transformer_checkpoint_to_diffusers`): q, k and v fused in
    `attention.qkv`, and the renames above; a top-level parameter (the padding tokens) is its own entry."""
    modules: dict[str, list[str]] = {}
    for key in keys:
        module, _, parameter = key.rpartition(".")
        modules.setdefault(module, []).append(parameter)
    entries = []
    for module, parameters in modules.items():
        if not module:  # x_pad_token, cap_pad_token
            entries += [layout.Entry(name, (name,), params=(("", ""),)) for name in parameters]
            continue
        params = tuple((p, p) for p in parameters)
        if module.endswith(".attention.to_q"):
            stem = module.removesuffix(".to_q")
            entries.append(layout.Entry(f"{stem}.qkv", (f"{stem}.to_q", f"{stem}.to_k", f"{stem}.to_v"), params=params))
            continue
        if module.endswith((".attention.to_k", ".attention.to_v")):
            continue
        original = module
        for old, new in _TOP_RENAMES:
            if original.startswith(old.rstrip(".")):
                original = new.rstrip(".") + original[len(old.rstrip(".")):]
        for old, new in _RENAMES:
            if original.endswith(old):
                original = original[:-len(old)] + new
        entries.append(layout.Entry(original, (module,), params=params))
    return entries
