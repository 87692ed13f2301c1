"""Flux.3 (Klein base and its step-distilled Klein): per-mode then joint transformer blocks, Qwen3-VL as text encoder.

Everything follows diffusers' modular `Flux3AutoBlocks` (`Flux3ModularPipeline`; the distilled model:
`Flux3DistilledAutoBlocks`), which has no classic pipeline:

- **Text**: each caption as a user message through the chat template, right-padded to a multiple of 80 tokens (the
  pad tokens at position 1, masked as keys), through Qwen3-VL's language model; the hidden states of layers 4, 8,
  ..., 32 side by side (8 x the encoder's width per token). The transformer takes no mask: it attends to the pad
  tokens too. The text encoder is loaded apart (`llm_flow.py`). Each caption is cached with its own padded length;
  a batch of captions of different lengths gets the shorter ones lengthened with their own pad token's output
  (which every pad position shares), as the pipeline would have padded them.
- **Latents**: Flux.2's VAE and packing (`flux2.py`: 32 channels at 1/8, 2x2 patches normalised by the VAE's
  batch-norm statistics); position ids (0, row / 2, column / 2, 0) for the image, (0, 0, 0, token) for the text.
- **Timesteps**: t in [0, 1] (the transformer scales them), logit-normal and shifted by a constant 6.93 as the
  model's scheduler shifts them when sampling.
- **Sampling**: the modular blocks with the cached embeddings (the prompt upsampler and the text encoder step
  left out); classifier-free guidance above a scale of 1 against the negative prompt ("" by default); the distilled
  model (`flow_map`) without guidance.
- **Trained**: text-to-image; the reference-image stream (`x_embedders.image_cond`, `mode_blocks.image_cond`, its
  modulations) serves image editing only and never reaches the loss (`unused_denoiser_parts`).

Single files are Black Forest Labs' layout (`content_mode_blocks.image.0.q_proj`, `single_blocks.0.mlp_in`, ...), as
diffusers' `convert_flux3_transformer_checkpoint_to_diffusers` reads them; kohya LoRA names follow the same layout.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from modules.model.text_apart import HIDDEN, MASK, decoder_layers, padded, trimmed

from . import original_layout as layout
from .flow_base import FlowMatching, shipped
from .flux2 import PatchBatchNormLatents, image_ids, pack, text_ids, unpack
from .llm_flow import LLMFlowFamily, block_count, parameters_by_module

IMPLEMENTATION = "https://github.com/black-forest-labs/flux3"
PAD_MULTIPLE = 80
"""Captions are right-padded to a multiple of this many tokens (`Flux3TextEncoderStep(pad_multiple=80)`)."""
MAX_TEXT_TOKENS = 8192
"""`max_sequence_length` of the pipeline."""
TEXT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)
"""The hidden states stacked per token (`text_encoder_out_layers`); hidden state k is decoder layer k's output."""
IMAGE_ROPE_SCALE = 0.5
"""The image's row and column positions are scaled by this (`Flux3PrepareLatentsStep(image_rope_scale=0.5)`)."""


def flux3_image_ids(height: int, width: int, device) -> torch.Tensor:
    """[H/2 * W/2, 4] float position ids of the packed tokens of latents `height` x `width`, as `_prepare_image_ids`."""
    ids = image_ids(height, width, device, torch.float32)
    ids[:, 1:3] *= IMAGE_ROPE_SCALE
    return ids


def lengthened(hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each caption's rows beyond its own length filled with its last row (its pad tokens' output, the same at
    every pad position), so shorter captions of a batch read as the pipeline pads them."""
    hidden = hidden.clone()
    for i, length in enumerate(lengths):
        if 0 < length < hidden.shape[1]:
            hidden[i, length:] = hidden[i, length - 1]
    return hidden


class Flux3Objective(FlowMatching):
    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None):
        _, _, height, width = noisy.shape
        hidden, _, lengths = trimmed(text)
        hidden = lengthened(hidden, lengths)
        extra = {}
        if denoiser.config.get("flow_map"):  # distilled: trained to jump to the clean image
            extra["target_timestep"] = torch.zeros_like(timesteps)
        out = denoiser(hidden_states=pack(noisy), encoder_hidden_states=hidden, timestep=timesteps,
                       img_ids=flux3_image_ids(height, width, noisy.device),
                       txt_ids=text_ids(hidden.shape[1], noisy.device, torch.float32), return_dict=False, **extra)[0]
        return unpack(out, height, width)


class ModularSampler:
    """A modular pipeline called as Tandem's sampling calls a classic one: keyword arguments in (a `guider` among
    them sets that component), `.images` out."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline

    def __getattr__(self, name):
        # Everything else is the pipeline's: its components, `load_lora_weights`, `fuse_lora`.
        return getattr(self.__dict__["pipeline"], name)

    def __call__(self, **arguments):
        # The guider (its scale) is a component of a modular pipeline, not an input of the call.
        if "guider" in arguments:
            self.pipeline.update_components(guider=arguments.pop("guider"))
        return SimpleNamespace(images=self.pipeline(**arguments, output="images"))


class Flux3Family(PatchBatchNormLatents, LLMFlowFamily):
    transformer_class = "Flux3Transformer2DModel"
    vae_class = "AutoencoderKLFlux2"
    kohya_version = "flux3"
    kohya_implementation = IMPLEMENTATION
    modelspec_name = "flux-3"

    # ------------------------------------------------------------------ text

    def encode_with(self, encoder, tokenizer, captions, device):
        """{HIDDEN, MASK}: each caption's rows as the pipeline's `_get_qwen3_vl_prompt_embeds` gives them (its
        tokens and pad tokens up to its multiple of 80), all encoded in one batch padded to the longest."""
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                               add_generation_prompt=True) for caption in captions]
        real = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=MAX_TEXT_TOKENS).input_ids]
        lengths = [min(math.ceil(n / PAD_MULTIPLE) * PAD_MULTIPLE, MAX_TEXT_TOKENS) for n in real]
        tokens = tokenizer(texts, return_tensors="pt", padding="max_length", padding_side="right", truncation=True,
                           max_length=max(lengths))
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        positions = torch.arange(ids.shape[1], device=device)[None].expand_as(ids).masked_fill(mask == 0, 1)
        layers = self.text_encoder_layers(encoder)
        found: dict[int, torch.Tensor] = {}
        handles = [layers[k - 1].register_forward_hook(
            lambda module, args, output, k=k: found.__setitem__(k, output[0] if isinstance(output, tuple) else output))
            for k in TEXT_LAYERS]
        try:
            encoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        hidden = torch.cat([found[k] for k in TEXT_LAYERS], dim=-1)  # [B, L, 8 x width], layer-major per token
        return padded([row[:length] for row, length in zip(hidden, lengths)])

    def text_encoder_layers(self, encoder) -> list:
        return decoder_layers(encoder)

    # ------------------------------------------------------------------ training, sampling

    def objective(self, bundle, training_cfg=None):
        return Flux3Objective(bundle, training_cfg)

    def unused_denoiser_parts(self, bundle):
        """The reference images' stream (image editing): its input projection, its per-mode blocks and its two
        modulations; text-to-image training never feeds it."""
        denoiser = bundle.denoiser
        return [denoiser.x_embedders["image_cond"], denoiser.mode_blocks["image_cond"],
                denoiser.early_stream_modulations["image_cond"], denoiser.single_stream_modulations["image_cond"]]

    def repeated_blocks(self, bundle):
        """The text's, the image's and the reference images' per-mode blocks, then the joint single blocks (the
        registry's `block_groups`, dotted paths into `mode_blocks`)."""
        transformer = bundle.denoiser
        return [block for group in self.info.block_groups for block in transformer.get_submodule(group)]

    def is_distilled(self, bundle) -> bool:
        return bool(bundle.denoiser.config.get("flow_map"))

    def guides(self, guidance_scale: float) -> bool:
        return guidance_scale > 1

    def pipeline(self, bundle):
        from diffusers import Flux3AutoBlocks, Flux3DistilledAutoBlocks

        blocks = Flux3DistilledAutoBlocks() if self.is_distilled(bundle) else Flux3AutoBlocks()
        for step in ("prompt_upsampler", "text_encoder"):  # the cached embeddings are passed in
            if step in blocks.sub_blocks:
                blocks.sub_blocks.pop(step)
        pipeline = blocks.init_pipeline()
        pipeline.update_components(transformer=bundle.denoiser, vae=bundle.vae,
                                   scheduler=self.sampling_scheduler(bundle))
        return ModularSampler(pipeline)

    def stock_pipeline(self, folder):
        """The modular pipeline a diffusers user builds over the folder (its blocks by `model_index.json`'s class:
        a model_index.json alone does not tell `ModularPipeline.from_pretrained` the blocks), its denoising parts
        loaded; the text encoder and the processor stay out (the tests pass embeddings)."""
        import json

        import diffusers

        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
        cls = getattr(diffusers, index["_class_name"])
        pipeline = cls(blocks=getattr(diffusers, cls.default_blocks_name)(), pretrained_model_name_or_path=str(folder))
        pipeline.load_components(names=["transformer", "vae", "scheduler"], local_files_only=True)
        return pipeline

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        arguments = {"prompt_embeds": self._caption(bundle, prompt.prompt)}
        if self.is_distilled(bundle):
            return arguments
        from diffusers.guiders import ClassifierFreeGuidance

        guider = ClassifierFreeGuidance(guidance_scale=guidance_scale, enabled=self.guides(guidance_scale))
        arguments["guider"] = guider
        if self.guides(guidance_scale):
            arguments["negative_prompt_embeds"] = self._caption(bundle, self.negative_prompt(prompt))
        return arguments

    def _caption(self, bundle, text: str) -> torch.Tensor:
        """The pipeline's `prompt_embeds` of one prompt: [1, its padded length, 8 x width]."""
        hidden, mask = self.prompt_embeddings(bundle, text)
        return hidden[:, :int(mask.sum())]

    def cached_shapes(self):
        """32 latent channels (packed to 128); 240 text tokens of Qwen3-VL 4B's 8 x 2560 features, and their mask."""
        return 32, {HIDDEN: (240, 20480), MASK: (240,)}

    def build_demo(self, root=None):
        from .flux3_demo import ensure_flux3_demo

        return ensure_flux3_demo(root)

    def random_model_tokenizer(self):
        from .qwen_image21_demo import demo_qwen3vl_tokenizer

        return demo_qwen3vl_tokenizer()

    # ------------------------------------------------------------------ single files

    def layout(self, config, keys):
        return flux3_entries(keys)

    def owns_key(self, key):
        return not key.startswith(("vae.", "first_stage_model.", "text_encoders.", "repa_projectors."))

    def shipped_transformer_config(self, state):
        """Flux.3's config, with the sizes a file's weights show (depths, widths, heads, text width, flow map)."""
        config = shipped("flux3", "transformer")
        if not state:
            return config
        head_dim = state["single_blocks.0.norm.query_norm.scale"].shape[0]
        inner, in_channels = state["emb_in.image.weight"].shape
        return {**config, "num_layers": block_count(state, r"content_mode_blocks\.image\.(\d+)\."),
                "num_single_layers": block_count(state, r"single_blocks\.(\d+)\."), "attention_head_dim": head_dim,
                "num_attention_heads": inner // head_dim, "in_channels": in_channels,
                "cond_in_channels": state["emb_in.image_cond.weight"].shape[1],
                "joint_attention_dim": state["txt_in.weight"].shape[1],
                "timestep_channels": state["time_in.in_layer.weight"].shape[1],
                "mlp_ratio": state["single_blocks.0.mlp_out.weight"].shape[1] / inner,
                "flow_map": "ref_time_in.in_layer.weight" in state}


_BLOCK_RENAMES = (("attn.to_q", "q_proj"), ("attn.to_k", "k_proj"), ("attn.to_v", "v_proj"),
                  ("attn.to_out.0", "attn_out"), ("ff.linear_in", "mlp_in"), ("ff.linear_out", "mlp_out"))
_PREFIX_RENAMES = (("x_embedders.", "emb_in."), ("context_embedder", "txt_in"), ("mode_blocks.", "content_mode_blocks."),
                   ("single_transformer_blocks.", "single_blocks."))
_MODULE_RENAMES = {"timestep_embedder.linear_1": "time_in.in_layer", "timestep_embedder.linear_2": "time_in.out_layer",
                   "target_timestep_embedder.linear_1": "ref_time_in.in_layer",
                   "target_timestep_embedder.linear_2": "ref_time_in.out_layer",
                   "proj_out": "final_layer.image.linear"}


def flux3_entries(keys) -> list[layout.Entry]:
    """Every module of a Flux.3 transformer with these (diffusers) weights, diffusers <-> Black Forest Labs names
    (the reverse of diffusers' `convert_flux3_transformer_checkpoint_to_diffusers`). No layer has a bias; the
    output norm's modulation rows are [shift, scale] in the original, [scale, shift] in diffusers."""
    entries = []
    for module, parameters in parameters_by_module(keys).items():
        params = tuple((p, p) for p in parameters)
        if module == "norm_out.linear":
            entries.append(layout.Entry("final_layer.image.adaLN_modulation.1", (module,), swap_halves=True))
            continue
        original = _MODULE_RENAMES.get(module, module)
        for old, new in _PREFIX_RENAMES:
            if original.startswith(old):
                original = new + original[len(old):]
                break
        if original.endswith((".attn.norm_q", ".attn.norm_k")):  # RMSNorm weights: `norm.query_norm.scale`
            name = "query_norm" if original.endswith("_q") else "key_norm"
            entries.append(layout.Entry(f"{original[:-len('.attn.norm_q')]}.norm.{name}", (module,),
                                        params=(("scale", "weight"),)))
            continue
        for old, new in _BLOCK_RENAMES:
            if original.endswith("." + old):
                original = original[:-len(old)] + new
                break
        if original.endswith(".linear") and "modulations." in original:
            original = original[:-len(".linear")] + ".lin"
        entries.append(layout.Entry(original, (module,), params=params))
    return entries
