"""Qwen-Image: a 20 B double-stream transformer on packed latents, Qwen2.5-VL as text encoder, rectified flow.

Everything follows diffusers' `QwenImagePipeline`:

- **Text**: each caption inside Qwen-Image's prompt template (a system prompt asking to describe the
  image), through Qwen2.5-VL; the last layer's hidden states of the caption's own tokens - the template's
  first 34 dropped - at most 512 of them, with a mask (`text_apart.py`). The text encoder is loaded apart
  (`llm_flow.py`): only to fill the text cache, before the transformer.
- **Latents**: its own VAE (`AutoencoderKLQwenImage`, Wan's causal 3-D VAE; an image is one frame): 16
  channels at 1/8 of the image, normalised per channel by the VAE's `latents_mean` / `latents_std`, packed
  into 2x2 patches (one token each) as Flux packs them - so image sides are multiples of 16 px.
- **Transformer**: timesteps as t in [0, 1]; the text mask joins the attention mask; `img_shapes` give the
  image positions (rotary embeddings centred on the image).
- **Timesteps**: logit-normal t shifted by image size exactly as the scheduler shifts it when sampling
  (`use_dynamic_shifting`, mu from 256 to 8192 tokens between 0.5 and 0.9).
- **Sampling**: true classifier-free guidance with the pipeline's norm rescaling (`true_cfg_scale` =
  `sampling.guidance_scale`; a negative prompt of " " when none is given, as Qwen's examples do).

Single files are diffusers' own names (the layout of the released `qwen_image_bf16.safetensors`, which
ComfyUI reads; `model.diffusion_model.` in front is accepted too). The kohya LoRA layout is
`lora_unet_` + those names with `_` (musubi-tuner's), see docs/Models.md.
"""
from __future__ import annotations

import torch

from modules.model.text_apart import HIDDEN, MASK, masked_rows, padded, trimmed

from .flow_base import ChannelNormalizedLatents, FlowMatching, shipped
from .flux import pack_latents, unpack_latents
from .llm_demo import QWEN_IMAGE_DROP, QWEN_IMAGE_TEMPLATE
from .llm_flow import BUNDLED_PARTS, MAX_TEXT_TOKENS, LLMFlowFamily, block_count, identity_entries

IMPLEMENTATION = "https://github.com/QwenLM/Qwen-Image"


class QwenImageObjective(FlowMatching):
    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None):
        batch, _, height, width = noisy.shape
        hidden, mask, _ = trimmed(text)
        out = denoiser(hidden_states=pack_latents(noisy), timestep=timesteps, encoder_hidden_states=hidden,
                       encoder_hidden_states_mask=mask, img_shapes=[[(1, height // 2, width // 2)]] * batch,
                       return_dict=False)[0]
        return unpack_latents(out, height, width)


class QwenImageFamily(ChannelNormalizedLatents, LLMFlowFamily):
    transformer_class = "QwenImageTransformer2DModel"
    vae_class = "AutoencoderKLQwenImage"
    file_prefix = ""
    kohya_version = "qwen_image"
    kohya_implementation = IMPLEMENTATION
    modelspec_name = "qwen-image"

    # ------------------------------------------------------------------ latents

    def _latent_distribution(self, bundle, pixels):
        """The VAE's posterior for images as one-frame videos, the frame axis dropped again. A VAE that reads RGBA
        (Qwen-Image 2.1's) gets the images opaque, as its pipeline passes an RGB picture."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"encode_images expects pixels of shape [B, 3, H, W], got {tuple(pixels.shape)}")
        vae_param = next(bundle.vae.parameters())
        pixels = pixels.to(device=vae_param.device, dtype=vae_param.dtype)
        alpha = bundle.vae.config.get("in_channels", 3) - pixels.shape[1]
        if alpha > 0:
            pixels = torch.cat([pixels, pixels.new_ones(pixels.shape[0], alpha, *pixels.shape[2:])], dim=1)
        posterior = bundle.vae.encode(pixels.unsqueeze(2)).latent_dist
        return DiagonalGaussianDistribution(torch.cat([posterior.mean, posterior.logvar], dim=1).squeeze(2))

    def decode_latents(self, bundle, latents):
        """Pixels [B, 3, H, W]: an RGBA VAE's alpha plane is left out (what Tandem renders and compares is RGB)."""
        vae_param = next(bundle.vae.parameters())
        latents = self.denormalize_latents(bundle, latents.to(device=vae_param.device, dtype=vae_param.dtype))
        return bundle.vae.decode(latents.unsqueeze(2)).sample[:, :3, 0].clamp(-1, 1)

    def load_vae(self, path, dtype, config=None):
        raise ValueError(f"model.vae_path {str(path)!r} is a single file; a {self.info.title} VAE is read from a "
                         "diffusers folder (one with config.json, or a model folder with vae/): point model.vae_path at "
                         "one, or leave it empty for the model's own VAE")

    # ------------------------------------------------------------------ text

    def encode_with(self, encoder, tokenizer, captions, device):
        texts = [QWEN_IMAGE_TEMPLATE.format(caption) for caption in captions]
        tokens = tokenizer(texts, max_length=QWEN_IMAGE_DROP + 1024, padding=True, truncation=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state  # the pipeline's hidden_states[-1]
        rows = [row[QWEN_IMAGE_DROP:][:MAX_TEXT_TOKENS] for row in masked_rows(hidden, mask)]
        return padded(rows)

    # ------------------------------------------------------------------ training, sampling

    def objective(self, bundle, training_cfg=None):
        return QwenImageObjective(bundle, training_cfg)

    def unused_denoiser_parts(self, bundle):
        """The last block's text-stream outputs: its attention's text projection (`attn.to_add_out`) and its text
        MLP only feed the text tokens to a next block, and there is none (the prediction is the image stream's)."""
        last = bundle.denoiser.transformer_blocks[-1]
        return [last.attn.to_add_out, last.txt_mlp]

    def pipeline(self, bundle):
        from diffusers import QwenImagePipeline

        side = bundle.extra.get("text_side")
        return QwenImagePipeline(scheduler=self.sampling_scheduler(bundle), vae=bundle.vae, text_encoder=None,
                                 tokenizer=side.tokenizer if side is not None else None, transformer=bundle.denoiser)

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        embeds, mask = self.prompt_embeddings(bundle, prompt.prompt)
        arguments = {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "max_sequence_length": MAX_TEXT_TOKENS,
                     "true_cfg_scale": guidance_scale}
        if self.guides(guidance_scale):
            negative, negative_mask = self.prompt_embeddings(bundle, self.negative_prompt(prompt))
            arguments.update(negative_prompt_embeds=negative, negative_prompt_embeds_mask=negative_mask)
        return arguments

    def negative_prompt(self, prompt) -> str:
        """Its own, else " ": the pipeline guides only with a negative prompt, and Qwen's examples give " "."""
        return prompt.negative_prompt or " "

    def cached_shapes(self):
        """256 text tokens (the raw reference's) of Qwen2.5-VL's 3584 features, and their mask."""
        return 16, {HIDDEN: (256, 3584), MASK: (256,)}

    def build_demo(self, root=None):
        from .llm_demo_models import ensure_llm_demo

        return ensure_llm_demo("qwen", root)

    # ------------------------------------------------------------------ single files

    def layout(self, config, keys):
        return identity_entries(keys)

    other_parts = BUNDLED_PARTS + ("conditioner.",)

    def shipped_transformer_config(self, state):
        """The family's config, with the sizes a file's weights show (its depth, widths, channels)."""
        config = shipped(self.name, "transformer")
        if not state:
            return config
        head_dim = state["transformer_blocks.0.attn.norm_q.weight"].shape[0]
        inner, in_channels = state["img_in.weight"].shape
        return {**config, "num_layers": block_count(state, r"transformer_blocks\.(\d+)\."),
                "attention_head_dim": head_dim, "num_attention_heads": inner // head_dim, "in_channels": in_channels,
                **self.file_sizes(state, inner)}

    def file_sizes(self, state, inner: int) -> dict:
        """The config's other sizes a file's weights show (`inner`: the transformer's width): Qwen-Image's output
        channels (2x2 patches) and text width."""
        return {"out_channels": state["proj_out.weight"].shape[0] // 4,
                "joint_attention_dim": state["txt_in.weight"].shape[1]}
