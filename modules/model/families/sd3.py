"""Stable Diffusion 3 and 3.5 (Medium, Large): an MMDiT transformer, CLIP-L + CLIP-G + T5-XXL, rectified flow.

Text conditioning follows `StableDiffusion3Pipeline.encode_prompt`: the penultimate hidden states of
both CLIP encoders side by side, zero-padded to T5's width and followed by T5's sequence (77 + 256
tokens), and both CLIP encoders' pooled projections side by side (768 + 1280). The transformer gets
the timestep as t x 1000, as the pipeline gives it.

Single files are in Stability's layout: `model.diffusion_model.joint_blocks.N.x_block.attn.qkv...` for
the transformer (q, k, v fused) and `first_stage_model.*` for the VAE (`sd3.5_medium.safetensors`).
"""
from __future__ import annotations

import json
import re
from typing import Sequence

import torch

from modules.model.sample_texts import sample_text, texts_ready

from . import original_layout as layout
from .flow_base import META_CONFIGS, FlowFamily, FlowMatching, _device_of, _dtype_of, plain_config, shipped

FILE_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."


class SD3Objective(FlowMatching):
    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None):
        return denoiser(hidden_states=noisy, timestep=timesteps * 1000,
                        encoder_hidden_states=text["encoder_hidden_states"],
                        pooled_projections=text["pooled"], return_dict=False)[0]


class SD3Family(FlowFamily):
    transformer_class = "SD3Transformer2DModel"
    clip_classes = ("CLIPTextModelWithProjection", "CLIPTextModelWithProjection")
    default_t5_length = 256
    file_prefix = FILE_PREFIX
    kohya_version = "sd3"

    def modelspec_architecture(self, bundle) -> str:
        """sd-scripts' names (`sd3_utils.analyze_state_dict_state`): SD3 Medium has no q/k norms, SD3.5 Medium
        has them and dual-attention blocks, SD3.5 Large has them without."""
        config = bundle.denoiser.config
        if not config.get("qk_norm"):
            return "stable-diffusion-3-medium"
        return "stable-diffusion-3-5-medium" if config.get("dual_attention_layers") else "stable-diffusion-3-5-large"

    # ------------------------------------------------------------------ text

    def encode_text(self, bundle, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """`encoder_hidden_states` [B, 77 + T5 length, T5 width] and `pooled` [B, CLIP-L + CLIP-G projections]."""
        ids = bundle.tokenize(captions)
        clip_dtype = _dtype_of(bundle.text_encoders[0])
        hidden, pooled = [], []
        for encoder, token_ids in zip(bundle.text_encoders[:2], ids[:2]):
            output = encoder(token_ids.to(_device_of(encoder)), output_hidden_states=True)
            pooled.append(output[0])
            hidden.append(output.hidden_states[-2].to(dtype=clip_dtype))
        t5 = self.encode_t5(bundle, ids[2])
        clip = torch.cat([h.to(t5.device) for h in hidden], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {"encoder_hidden_states": torch.cat([clip, t5], dim=-2),
                "pooled": torch.cat([p.to(t5.device) for p in pooled], dim=-1)}

    # ------------------------------------------------------------------ training, sampling

    def objective(self, bundle, training_cfg=None):
        return SD3Objective(bundle, training_cfg)

    def pipeline(self, bundle):
        from diffusers import StableDiffusion3Pipeline

        encoders, tokenizers = bundle.text_encoders, bundle.tokenizers
        return StableDiffusion3Pipeline(
            transformer=bundle.denoiser, scheduler=self.sampling_scheduler(bundle), vae=bundle.vae,
            text_encoder=encoders[0], tokenizer=tokenizers[0], text_encoder_2=encoders[1],
            tokenizer_2=tokenizers[1], text_encoder_3=encoders[2], tokenizer_3=tokenizers[2])

    samples_from_embeddings = True

    def texts_for_samples(self, prompts, guidance_scale):
        """The prompts, and their negative prompts ("" where none: the pipeline's) where the scale guides."""
        texts = [prompt.prompt for prompt in prompts]
        if guidance_scale > 1:  # StableDiffusion3Pipeline's do_classifier_free_guidance
            texts += [prompt.negative_prompt or "" for prompt in prompts]
        return list(dict.fromkeys(texts))

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        if not texts_ready(bundle, [prompt], guidance_scale):
            return super().pipeline_arguments(bundle, prompt, guidance_scale)
        text = sample_text(bundle, prompt.prompt)
        arguments = {"prompt_embeds": text["encoder_hidden_states"], "pooled_prompt_embeds": text["pooled"],
                     "guidance_scale": guidance_scale, "max_sequence_length": bundle.text_lengths()[-1]}
        if guidance_scale > 1:
            negative = sample_text(bundle, prompt.negative_prompt or "")
            arguments.update(negative_prompt_embeds=negative["encoder_hidden_states"],
                             negative_pooled_prompt_embeds=negative["pooled"])
        return arguments

    def model_index_extras(self, bundle):
        return {"image_encoder": [None, None], "feature_extractor": [None, None]}

    def cached_shapes(self):
        """CLIP's 77 + T5's 256 tokens at T5-XXL's width; CLIP-L's 768 + CLIP-G's 1280 pooled."""
        return 16, {"encoder_hidden_states": (77 + 256, 4096), "pooled": (2048,)}

    def build_demo(self, root=None):
        from .dit_demo import ensure_dit_demo

        return ensure_dit_demo("sd3", root)

    # ------------------------------------------------------------------ single files

    def layout(self, config, keys):
        return layout.keep_present(sd3_entries(config["num_layers"]), keys)

    def owns_key(self, key):
        return not key.startswith((VAE_PREFIX, "text_encoders.", "cond_stage_model.", "conditioner."))

    def shipped_transformer_config(self, state):
        """SD3.5 Medium's or Large's config by depth; attention layout (dual attention, qk norm) from the key names."""
        if not state:
            return shipped("sd3", "transformer")
        depth = 1 + max(int(m[1]) for k in state if (m := re.match(r"joint_blocks\.(\d+)\.", k)))
        config = shipped("sd3", "transformer_large" if depth == 38 else "transformer")
        dual = sorted({int(m[1]) for k in state if (m := re.match(r"joint_blocks\.(\d+)\.x_block\.attn2\.", k))})
        has_qk_norm = any(".attn.ln_q." in k for k in state)
        return {**config, "num_layers": depth, "dual_attention_layers": dual,
                "qk_norm": "rms_norm" if has_qk_norm else None}

    def vae_from_file(self, state, metadata, path):
        from modules.model.single_file import _load_vae_from_state

        vae_state = {k: v for k, v in state.items() if k.startswith(VAE_PREFIX)}
        if not vae_state:
            return None
        recorded = json.loads(metadata[META_CONFIGS]).get("vae") if META_CONFIGS in metadata else None
        return _load_vae_from_state(vae_state, recorded or shipped("sd3", "vae"), path)

    def extra_file_parts(self, bundle, configs):
        from modules.model.ldm_layout import vae_to_ldm
        from modules.model.streamed_save import FilePart

        vae = bundle.vae
        configs["vae"] = plain_config(vae.config)
        return [FilePart(vae, vae.state_dict, lambda piece: vae_to_ldm(piece, vae.config, prefix=VAE_PREFIX))]


def sd3_entries(num_layers: int) -> list[layout.Entry]:
    """Every module an SD3/SD3.5 transformer of `num_layers` joint blocks may have, diffusers <-> Stability
    names (the reverse of diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`); `keep_present`
    drops the ones a given model lacks (qk norms, dual attention, the last block's context outputs)."""
    E, norm = layout.Entry, (("weight", "weight"),)
    entries = [
        E("pos_embed", ("pos_embed",), params=(("", "pos_embed"),)),
        E("x_embedder.proj", ("pos_embed.proj",)),
        E("t_embedder.mlp.0", ("time_text_embed.timestep_embedder.linear_1",)),
        E("t_embedder.mlp.2", ("time_text_embed.timestep_embedder.linear_2",)),
        E("y_embedder.mlp.0", ("time_text_embed.text_embedder.linear_1",)),
        E("y_embedder.mlp.2", ("time_text_embed.text_embedder.linear_2",)),
        E("context_embedder", ("context_embedder",)),
        E("final_layer.linear", ("proj_out",)),
        E("final_layer.adaLN_modulation.1", ("norm_out.linear",), swap_halves=True),
    ]
    for i in range(num_layers):
        x, c, d = f"joint_blocks.{i}.x_block", f"joint_blocks.{i}.context_block", f"transformer_blocks.{i}"
        last = i == num_layers - 1
        entries += [
            *layout.joint_attention(f"{x}.attn", f"{c}.attn", d, "ln_q", "ln_k", norm),
            E(f"{x}.attn2.qkv", (f"{d}.attn2.to_q", f"{d}.attn2.to_k", f"{d}.attn2.to_v")),
            E(f"{x}.attn2.ln_q", (f"{d}.attn2.norm_q",), params=norm),
            E(f"{x}.attn2.ln_k", (f"{d}.attn2.norm_k",), params=norm),
            E(f"{x}.attn2.proj", (f"{d}.attn2.to_out.0",)),
            E(f"{x}.adaLN_modulation.1", (f"{d}.norm1.linear",)),
            # The last block only conditions the image stream: its context norm is the final-norm kind.
            E(f"{c}.adaLN_modulation.1", (f"{d}.norm1_context.linear",), swap_halves=last),
            E(f"{x}.mlp.fc1", (f"{d}.ff.net.0.proj",)),
            E(f"{x}.mlp.fc2", (f"{d}.ff.net.2",)),
            E(f"{c}.mlp.fc1", (f"{d}.ff_context.net.0.proj",)),
            E(f"{c}.mlp.fc2", (f"{d}.ff_context.net.2",)),
        ]
    return entries



