"""Lumina 2 (Lumina-Image 2.0): a 2.6 B single-stream transformer, Gemma 2 (2B) as text encoder, rectified flow.

Everything follows diffusers' `Lumina2Pipeline`:

- **Text**: each caption after the pipeline's system prompt (`SYSTEM_PROMPT + " <Prompt Start> " + caption`),
  through Gemma 2; the second-to-last layer's hidden states (the pipeline's `hidden_states[-2]`) of every token,
  the system prompt's included, at most 256, with a mask (`text_apart.py`). The pipeline encodes its negative
  prompts without the system prompt; so does this module (`negative_prompt`). The text encoder is loaded apart
  (`llm_flow.py`): only to fill the text cache, before the transformer.
- **Latents**: Flux.1's VAE (16 channels at 1/8, shift and scale as its config says), 2x2 patches inside the
  transformer, so image sides are multiples of 16 px.
- **Transformer**: the caption's tokens, then the image's, in one sequence (the mask says how many of each row's
  caption tokens are real; they must come first). Its time input runs the other way - t = 1 is the clean
  image, the pipeline passes 1 - sigma - and its output is the negative velocity, which the pipeline negates
  before its Euler step: `Lumina2Objective.predict` does both.
- **Timesteps**: logit-normal t shifted as the scheduler shifts it (Lumina-Image 2.0's: a fixed 6). Where a
  scheduler shifts by image size, the pipeline computes the size from `latents.shape[1]` - the latent channels,
  not the tokens - and training follows it, so training and sampling shift alike.
- **Sampling**: classifier-free guidance above a scale of 1 with the pipeline's norm rescaling
  (`cfg_normalization`), the negative prompt "" when none is given (as Lumina's examples do).

Single files are in the original release layout (Alpha-VLLM's and ComfyUI's `lumina_2_model_bf16.safetensors`,
`model.diffusion_model.` in front or not): q, k and v fused in `attention.qkv` (Gemma-style grouped heads: k and
v are narrower than q), `feed_forward.w1/w2/w3`, `adaLN_modulation.1`, `cap_embedder`, `t_embedder.mlp`,
`final_layer`. The kohya LoRA layout uses those names (`lora_unet_layers_0_attention_qkv`), which ComfyUI reads
for Lumina 2; diffusers reads the peft layout (see docs/Models.md).
"""
from __future__ import annotations

import torch

from modules.model.text_apart import HIDDEN, MASK, masked_rows, output_of, padded, trimmed

from . import original_layout as layout
from .flow_base import FlowMatching, shipped
from .llm_flow import NEXT_DIT_PARTS, LLMFlowFamily, block_count

IMPLEMENTATION = "https://github.com/Alpha-VLLM/Lumina-Image-2.0"
SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of image-text "
                 "alignment based on textual prompts or user prompts.")
"""`Lumina2Pipeline.system_prompt`."""
PROMPT_START = " <Prompt Start> "
"""What the pipeline puts between the system prompt and the caption."""
MAX_TEXT_TOKENS = 256
"""Tokens per text at most, the system prompt's included: the pipeline's `max_sequence_length`."""
AS_IS = "\x00"
"""Marks a text the pipeline encodes without the system prompt (its negative prompts) in the text cache."""


class Lumina2Objective(FlowMatching):
    def image_tokens(self, latent_shape):
        """What `Lumina2Pipeline` shifts by where its scheduler shifts by size: `latents.shape[1]`, the channels."""
        return latent_shape[1]

    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None):
        hidden, mask, _ = trimmed(text)
        if mask is None:  # the transformer counts each caption's tokens from the mask: it always needs one
            mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        out = denoiser(hidden_states=noisy, timestep=1 - timesteps, encoder_hidden_states=hidden,
                       encoder_attention_mask=mask, return_dict=False)[0]
        return -out


class Lumina2Family(LLMFlowFamily):
    transformer_class = "Lumina2Transformer2DModel"
    vae_class = "AutoencoderKL"
    file_prefix = ""
    kohya_version = "lumina2"
    kohya_implementation = IMPLEMENTATION
    modelspec_name = "lumina-2"

    # ------------------------------------------------------------------ text

    def encode_with(self, encoder, tokenizer, captions, device):
        texts = [c[len(AS_IS):] if c.startswith(AS_IS) else SYSTEM_PROMPT + PROMPT_START + c for c in captions]
        # Right padding, as the pipeline sets it: the transformer takes each row's real tokens from its front.
        tokens = tokenizer(texts, padding=True, max_length=MAX_TEXT_TOKENS, truncation=True, padding_side="right",
                           return_tensors="pt")
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        hidden = output_of(self.text_encoder_layers(encoder)[-2], lambda: encoder(input_ids=ids, attention_mask=mask))
        return padded(masked_rows(hidden, mask))

    def negative_prompt(self, prompt) -> str:
        """Its own, else "" - encoded without the system prompt, as the pipeline encodes negative prompts."""
        return AS_IS + (prompt.negative_prompt or "")

    def random_model_tokenizer(self):
        from .gemma_demo import demo_gemma_tokenizer

        return demo_gemma_tokenizer()

    # ------------------------------------------------------------------ training, sampling

    def objective(self, bundle, training_cfg=None):
        return Lumina2Objective(bundle, training_cfg)

    def pipeline(self, bundle):
        from diffusers import Lumina2Pipeline

        side = bundle.extra.get("text_side")
        return Lumina2Pipeline(transformer=bundle.denoiser, scheduler=self.sampling_scheduler(bundle), vae=bundle.vae,
                               text_encoder=None, tokenizer=side.tokenizer if side is not None else None)

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        embeds, mask = self.prompt_embeddings(bundle, prompt.prompt)
        arguments = {"guidance_scale": guidance_scale, "max_sequence_length": MAX_TEXT_TOKENS}
        if self.guides(guidance_scale):
            negative, negative_mask = self.prompt_embeddings(bundle, self.negative_prompt(prompt))
            # The pipeline wants both of one shape (its own encoding pads both to 256 tokens).
            length = max(embeds.shape[1], negative.shape[1])
            arguments.update(negative_prompt_embeds=_pad_to(negative, length),
                             negative_prompt_attention_mask=_pad_to(negative_mask, length))
            embeds, mask = _pad_to(embeds, length), _pad_to(mask, length)
        arguments.update(prompt_embeds=embeds, prompt_attention_mask=mask)
        return arguments

    def cached_shapes(self):
        """256 text tokens (the pipeline's length) of Gemma 2's 2304 features, and their mask."""
        return 16, {HIDDEN: (256, 2304), MASK: (256,)}

    def build_demo(self, root=None):
        from .lumina2_demo import ensure_lumina2_demo

        return ensure_lumina2_demo(root)

    # ------------------------------------------------------------------ single files

    def layout(self, config, keys):
        return lumina2_entries(keys)

    other_parts = NEXT_DIT_PARTS

    def shipped_transformer_config(self, state):
        """Lumina 2's config, with the sizes a file's weights show (depths, width, heads, caption features)."""
        config = shipped("lumina2", "transformer")
        if not state:
            return config
        hidden, patch_features = state["x_embedder.weight"].shape
        head_dim = state["layers.0.attention.q_norm.weight"].shape[0]
        kv_rows = (state["layers.0.attention.qkv.weight"].shape[0] - hidden) // 2
        inner = state["layers.0.feed_forward.w1.weight"].shape[0]
        found = {**config, "hidden_size": hidden, "num_attention_heads": hidden // head_dim,
                 "num_kv_heads": kv_rows // head_dim, "num_layers": block_count(state, r"layers\.(\d+)\."),
                 "num_refiner_layers": block_count(state, r"noise_refiner\.(\d+)\."),
                 "cap_feat_dim": state["cap_embedder.0.weight"].shape[0],
                 "in_channels": patch_features // config["patch_size"] ** 2}
        multiple = found["multiple_of"]
        if multiple * ((4 * hidden + multiple - 1) // multiple) != inner:
            # Another feed-forward width: a multiplier and rounding that give exactly `inner`.
            found.update(multiple_of=inner, ffn_dim_multiplier=inner / (4 * hidden))
        return found

    # ------------------------------------------------------------------ LoRA

    def lycoris_module_name(self, bundle, component, module_path):
        """`lora_unet_` + the original name of a module the original layout keeps whole (ComfyUI's names for Lumina
        2); q, k and v are one fused weight there, so their adapters keep SimpleTuner's `lycoris_<diffusers path>`,
        which ComfyUI does not apply to a Lumina 2 model (docs/Models.md)."""
        whole = _whole_modules(bundle)
        if module_path in whole:
            return "lora_unet_" + whole[module_path].replace(".", "_")
        return super().lycoris_module_name(bundle, component, module_path)


def _whole_modules(bundle) -> dict[str, str]:
    """Diffusers module path -> original path of the modules the original layout keeps whole."""
    keys = [k.replace(".base_layer", "") for k in bundle.denoiser.state_dict() if ".lora_" not in k
            and not any(f".{kind}_" in k for kind in ("hada", "lokr"))]
    return {entry.parts[0]: entry.original for entry in lumina2_entries(keys) if len(entry.parts) == 1}


def _pad_to(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """`tensor` [B, L, ...] zero-padded along L to `length`."""
    extra = length - tensor.shape[1]
    if extra <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], extra, *tensor.shape[2:])], dim=1)


_TOP = (("time_caption_embed.caption_embedder", "cap_embedder"),
        ("time_caption_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
        ("time_caption_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
        ("norm_out.linear_1", "final_layer.adaLN_modulation.1"), ("norm_out.linear_2", "final_layer.linear"))
"""Diffusers -> original module paths outside the blocks (prefixes)."""
_IN_BLOCK = ((".attn.to_out.0", ".attention.out"), (".attn.norm_q", ".attention.q_norm"),
             (".attn.norm_k", ".attention.k_norm"), (".feed_forward.linear_1", ".feed_forward.w1"),
             (".feed_forward.linear_2", ".feed_forward.w2"), (".feed_forward.linear_3", ".feed_forward.w3"),
             (".norm1.linear", ".adaLN_modulation.1"), (".norm1.norm", ".attention_norm1"),
             (".norm1", ".attention_norm1"), (".norm2", ".attention_norm2"))
"""Diffusers -> original module suffixes inside a block (`norm1` is a modulated block's `LuminaRMSNormZero`, whose
`norm` and `linear` are the original's `attention_norm1` and `adaLN_modulation.1`; a context refiner block's
plain RMSNorm)."""


def lumina2_entries(keys) -> list[layout.Entry]:
    """Every module of a Lumina 2 transformer with these (diffusers) weights, diffusers <-> original names (the
    reverse of diffusers' `convert_lumina2_to_diffusers`): q, k and v fused in `attention.qkv`, and the renames
    above."""
    modules: dict[str, list[str]] = {}
    for key in keys:
        module, _, parameter = key.rpartition(".")
        modules.setdefault(module, []).append(parameter)
    entries = []
    for module, parameters in modules.items():
        params = tuple((p, p) for p in parameters)
        if module.endswith(".attn.to_q"):
            stem = module.removesuffix(".to_q")
            entries.append(layout.Entry(f"{stem.removesuffix('.attn')}.attention.qkv",
                                        (f"{stem}.to_q", f"{stem}.to_k", f"{stem}.to_v"), params=params))
            continue
        if module.endswith((".attn.to_k", ".attn.to_v")):
            continue
        entries.append(layout.Entry(_original_module(module), (module,), params=params))
    return entries


def _original_module(module: str) -> str:
    for diffusers_name, original in _TOP:
        if module == diffusers_name or module.startswith(diffusers_name + "."):
            return original + module[len(diffusers_name):]
    for diffusers_suffix, original in _IN_BLOCK:
        if module.endswith(diffusers_suffix):
            return module[:-len(diffusers_suffix)] + original
    return module
