"""Flux.1 (dev, schnell): a double/single-stream transformer on packed latents, CLIP-L + T5-XXL, rectified flow.

- **Text** follows `FluxPipeline.encode_prompt`: T5's sequence (512 tokens for dev, 256 for schnell) and
  CLIP-L's pooled output; text position ids are zeros.
- **Latents** (16 channels, 1/8 of the image) are packed into 2x2 patches of 64 values, one token each,
  with (0, row, column) position ids - so image sides are multiples of 16 px. The transformer's output
  is unpacked to the latents' shape for the loss.
- **Timesteps** go in as t in [0, 1] (the transformer scales them), shifted by image size as
  Flux.1-dev's scheduler shifts them (`use_dynamic_shifting`).
- **Guidance**: Flux.1-dev is guidance-distilled and takes the guidance value as an input; training
  gives it `training.flux_guidance` (1.0 by default, as kohya sd-scripts and ai-toolkit train),
  samples `sampling.guidance_scale`. Flux.1-schnell has no guidance input.

Single files are in Black Forest Labs' layout (`flux1-dev.safetensors`: `double_blocks.N.img_attn.qkv`,
`single_blocks.N.linear1` = q, k, v and the MLP input fused); the kohya LoRA layout uses the same
module names (`lora_unet_double_blocks_0_img_attn_qkv`), see docs/Models.md.
"""
from __future__ import annotations

import re
from typing import Sequence

import torch

from modules.model.lora_metadata import IMPLEMENTATION_FLUX
from modules.model.sample_texts import sample_text, texts_ready

from . import original_layout as layout
from .flow_base import FlowFamily, FlowMatching, _device_of, _dtype_of, shipped


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C]: each 2x2 patch one token, as `FluxPipeline._pack_latents`."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_latents` for latents of `height` x `width`."""
    b, _, channels = tokens.shape
    tokens = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return tokens.reshape(b, channels // 4, height, width)


def image_ids(height: int, width: int, device, dtype) -> torch.Tensor:
    """[H/2 * W/2, 3] position ids (0, row, column) of the packed tokens, as the pipeline makes them."""
    rows = torch.arange(height // 2, device=device, dtype=dtype)
    columns = torch.arange(width // 2, device=device, dtype=dtype)
    grid = torch.stack([torch.zeros(height // 2, width // 2, device=device, dtype=dtype),
                        rows[:, None].expand(-1, width // 2), columns[None, :].expand(height // 2, -1)], dim=-1)
    return grid.reshape(-1, 3)


class FluxObjective(FlowMatching):
    def __init__(self, bundle, training_cfg=None) -> None:
        super().__init__(bundle, training_cfg)
        self.guidance = None
        if self.takes_guidance(bundle.denoiser):
            self.guidance = training_cfg.flux_guidance if training_cfg is not None else 1.0

    @staticmethod
    def takes_guidance(denoiser) -> bool:
        """The transformer has a guidance input (dev, not schnell): it gets `training.flux_guidance`."""
        return bool(denoiser.config.get("guidance_embeds"))

    def guidance_input(self, noisy: torch.Tensor) -> torch.Tensor | None:
        """The guidance value for each sample of the batch, or None for a transformer without the input."""
        if self.guidance is None:
            return None
        return torch.full((noisy.shape[0],), float(self.guidance), device=noisy.device, dtype=torch.float32)

    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None):
        _, _, height, width = noisy.shape
        hidden = text["encoder_hidden_states"]
        out = denoiser(
            hidden_states=pack_latents(noisy), timestep=timesteps, guidance=self.guidance_input(noisy),
            pooled_projections=text["pooled"], encoder_hidden_states=hidden,
            txt_ids=torch.zeros(hidden.shape[1], 3, device=noisy.device, dtype=noisy.dtype),
            img_ids=image_ids(height, width, noisy.device, noisy.dtype), return_dict=False)[0]
        return unpack_latents(out, height, width)


class FluxFamily(FlowFamily):
    transformer_class = "FluxTransformer2DModel"
    clip_classes = ("CLIPTextModel",)
    file_prefix = ""
    kohya_version = "flux1"
    kohya_implementation = IMPLEMENTATION_FLUX

    def modelspec_architecture(self, bundle) -> str:
        return "flux-1-dev" if bundle.denoiser.config.get("guidance_embeds") else "flux-1-schnell"

    def t5_length_default(self, transformer) -> int:
        """512 tokens for Flux.1-dev, 256 for schnell (no guidance input), as `FluxPipeline` is used."""
        return 512 if transformer.config.get("guidance_embeds") else 256

    # ------------------------------------------------------------------ text

    def encode_text(self, bundle, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """`encoder_hidden_states` [B, T5 length, T5 width] (T5) and `pooled` [B, 768] (CLIP-L's pooled output)."""
        ids = bundle.tokenize(captions)
        clip = bundle.text_encoders[0]
        pooled = clip(ids[0].to(_device_of(clip)), output_hidden_states=False).pooler_output
        t5 = self.encode_t5(bundle, ids[1])
        return {"encoder_hidden_states": t5, "pooled": pooled.to(device=t5.device, dtype=_dtype_of(clip))}

    # ------------------------------------------------------------------ training, sampling

    def objective(self, bundle, training_cfg=None):
        return FluxObjective(bundle, training_cfg)

    def pipeline(self, bundle):
        from diffusers import FluxPipeline

        return FluxPipeline(
            scheduler=self.sampling_scheduler(bundle), vae=bundle.vae, text_encoder=bundle.text_encoders[0],
            tokenizer=bundle.tokenizers[0], text_encoder_2=bundle.text_encoders[1],
            tokenizer_2=bundle.tokenizers[1], transformer=bundle.denoiser)

    samples_from_embeddings = True

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        # Flux.1-dev's guidance is an input of the model, not classifier-free guidance: no negative prompt.
        arguments = {"guidance_scale": guidance_scale, "max_sequence_length": bundle.text_lengths()[-1]}
        if not texts_ready(bundle, [prompt], guidance_scale):
            return {"prompt": prompt.prompt, **arguments}
        text = sample_text(bundle, prompt.prompt)
        return {"prompt_embeds": text["encoder_hidden_states"], "pooled_prompt_embeds": text["pooled"], **arguments}

    def model_index_extras(self, bundle):
        return {"image_encoder": [None, None], "feature_extractor": [None, None]}

    def cached_shapes(self):
        """Flux.1-dev's 512 T5 tokens at T5-XXL's width; CLIP-L's 768 pooled."""
        return 16, {"encoder_hidden_states": (512, 4096), "pooled": (768,)}

    def build_demo(self, root=None):
        from .dit_demo import ensure_dit_demo

        return ensure_dit_demo("flux", root)

    # ------------------------------------------------------------------ single files

    def layout(self, config, keys):
        return layout.keep_present(flux_entries(config["num_layers"], config["num_single_layers"]), keys)

    def shipped_transformer_config(self, state):
        """Flux.1-dev's config, with the block counts and the guidance input the key names show
        (no `guidance_in`: schnell)."""
        if not state:
            return shipped("flux", "transformer")
        return {**shipped("flux", "transformer"), "num_layers": count_blocks(state, r"double_blocks\.(\d+)\."),
                "num_single_layers": count_blocks(state, r"single_blocks\.(\d+)\."),
                "guidance_embeds": any(k.startswith("guidance_in.") for k in state)}

    def owns_key(self, key):
        return not key.startswith(("vae.", "first_stage_model.", "text_encoders."))


def flux_entries(num_layers: int, num_single_layers: int) -> list[layout.Entry]:
    """Every module of a Flux transformer, diffusers <-> Black Forest Labs names (the reverse of diffusers'
    `convert_flux_transformer_checkpoint_to_diffusers`); `keep_present` drops the guidance input of schnell."""
    E = layout.Entry
    entries = [
        *bfl_embedder("time_in", "time_text_embed.timestep_embedder"),
        *bfl_embedder("vector_in", "time_text_embed.text_embedder"),
        *bfl_embedder("guidance_in", "time_text_embed.guidance_embedder"),
        E("txt_in", ("context_embedder",)),
        E("img_in", ("x_embedder",)),
        *bfl_final_layer(),
    ]
    for i in range(num_layers):
        o, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        entries += [
            E(f"{o}.img_mod.lin", (f"{d}.norm1.linear",)),
            E(f"{o}.txt_mod.lin", (f"{d}.norm1_context.linear",)),
            *bfl_double_block(o, d, "net.0.proj", "net.2"),
        ]
    for i in range(num_single_layers):
        o, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        entries += [
            E(f"{o}.modulation.lin", (f"{d}.norm.linear",)),
            E(f"{o}.linear1", (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp")),
            *bfl_single_norms(o, d),
            E(f"{o}.linear2", (f"{d}.proj_out",)),
        ]
    return entries


def count_blocks(state, pattern: str) -> int:
    """How many blocks a checkpoint's keys number: 1 + the largest index `pattern`'s group finds (0: none)."""
    return 1 + max((int(m[1]) for k in state if (m := re.match(pattern, k))), default=-1)


def bfl_widths(state, config: dict) -> dict:
    """The block counts and widths of a Black Forest Labs layout checkpoint (Chroma, Flux.2), over `config`'s
    head size where the checkpoint has no q/k norm to show it."""
    inner, in_channels = state["img_in.weight"].shape
    norm = "double_blocks.0.img_attn.norm.query_norm.scale"
    head = state[norm].shape[0] if norm in state else config["attention_head_dim"]
    return {"num_layers": count_blocks(state, r"double_blocks\.(\d+)\."),
            "num_single_layers": count_blocks(state, r"single_blocks\.(\d+)\."), "in_channels": in_channels,
            "attention_head_dim": head, "num_attention_heads": inner // head,
            "joint_attention_dim": state["txt_in.weight"].shape[1]}


# Black Forest Labs' names for the parts Flux and Flux.2 share (Flux.2 builds its table from these too).
_QK_SCALE = (("scale", "weight"),)


def bfl_embedder(original: str, embedder: str) -> list[layout.Entry]:
    """An MLP embedder: the original `in_layer`/`out_layer`, diffusers' `linear_1`/`linear_2`."""
    return [layout.Entry(f"{original}.in_layer", (f"{embedder}.linear_1",)),
            layout.Entry(f"{original}.out_layer", (f"{embedder}.linear_2",))]


def bfl_final_layer() -> list[layout.Entry]:
    """The output projection and the final norm's modulation (stored as (shift, scale))."""
    return [layout.Entry("final_layer.linear", ("proj_out",)),
            layout.Entry("final_layer.adaLN_modulation.1", ("norm_out.linear",), swap_halves=True)]


def bfl_double_block(o: str, d: str, ff_in: str, ff_out: str) -> list[layout.Entry]:
    """A double block's joint attention and its two streams' MLPs (original `o`, diffusers `d`);
    `ff_in`/`ff_out` name the MLP's layers under diffusers' `ff` and `ff_context`."""
    E = layout.Entry
    return [
        *layout.joint_attention(f"{o}.img_attn", f"{o}.txt_attn", d, "norm.query_norm", "norm.key_norm", _QK_SCALE),
        E(f"{o}.img_mlp.0", (f"{d}.ff.{ff_in}",)),
        E(f"{o}.img_mlp.2", (f"{d}.ff.{ff_out}",)),
        E(f"{o}.txt_mlp.0", (f"{d}.ff_context.{ff_in}",)),
        E(f"{o}.txt_mlp.2", (f"{d}.ff_context.{ff_out}",)),
    ]


def bfl_single_norms(o: str, d: str) -> list[layout.Entry]:
    """A single block's q/k norms."""
    return [layout.Entry(f"{o}.norm.query_norm", (f"{d}.attn.norm_q",), params=_QK_SCALE),
            layout.Entry(f"{o}.norm.key_norm", (f"{d}.attn.norm_k",), params=_QK_SCALE)]
