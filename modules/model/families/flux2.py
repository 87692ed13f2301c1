"""Flux.2 (dev 32B; Klein 4B and 9B): double/single-stream transformer, a language model as text encoder.

- **Variants**: dev (`Flux2Pipeline`: Mistral-Small-3.1 text encoder, guidance-distilled - the guidance
  value is an input, `training.flux_guidance` in training, `sampling.guidance_scale` in samples) and
  Klein (`Flux2KleinPipeline`: Qwen3-4B or Qwen3-8B, no guidance input; samples use true classifier-free
  guidance against an empty or the given negative prompt, unless the model is step-distilled). The
  transformer's `guidance_embeds` and the text encoder's class tell them apart.
- **Text** follows the pipelines' `encode_prompt` exactly (their own static functions are called): the
  chat template (dev with its system message), 512 tokens, and the hidden states of three layers side by
  side (dev 10/20/30, Klein 9/18/27) - 15360 (dev), 7680 or 12288 (Klein) values per token. Position ids
  have four axes (time, row, column, token): (0, 0, 0, l) for text, (0, row, column, 0) for the image.
- **Latents**: the VAE (`AutoencoderKLFlux2`) gives 32 channels at 1/8 of the image; the pipeline packs
  2x2 patches into 128 channels and normalises each with the VAE's batch-norm statistics. Tandem keeps
  the latents in the VAE's shape [B, 32, H/8, W/8] with each value normalised by its patch channel's
  statistics (`normalize_latents`) - the same numbers, rearranged - and packs them into tokens only for
  the transformer. Image sides are multiples of 16 px.
- **Timesteps**: t in [0, 1] (the transformer scales them), shifted by image size with the scheduler's
  law (`use_dynamic_shifting`, Flux.1-dev's constants). The pipeline samples with an "empirical" mu that
  also depends on the number of steps; at 200 steps it is exactly this law, with fewer steps it shifts
  further towards noise.

Single files are in Black Forest Labs' layout (`flux2-dev.safetensors`: `double_blocks.N.img_attn.qkv`,
`single_blocks.N.linear1` = q, k, v and the MLP input fused - in diffusers too, `attn.to_qkv_mlp_proj`),
and so are kohya LoRA names (`lora_unet_single_blocks_0_linear1`), which ComfyUI applies to its Flux.2
model and diffusers reads; see docs/Models.md.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Sequence

import torch

from modules.data.controls import sample_controls
from modules.model.files import SAVE_DTYPES
from modules.model.lora_metadata import IMPLEMENTATION_FLUX2
from modules.model.variants import component_variant

from . import original_layout as layout
from .flow_base import FLOW_MATCHING, FlowFamily, _device_of, _dtype_of, shipped
from .flux import FluxObjective, bfl_double_block, bfl_widths, bfl_embedder, bfl_final_layer, bfl_single_norms

TEXT_LENGTH = 512
"""Tokens per caption, as both pipelines are called (`max_sequence_length`; `model.text_max_length` sets
another); the chat template's own tokens (dev: its system message) are part of them."""
KLEIN = "Flux2KleinPipeline"
VARIANTS = ("dev", "klein-4b", "klein-9b")
"""The published sizes (`--variant` of the benchmark and make_random_model.py); dev first, the default."""
TEXT_WIDTH = {"dev": 15360, "klein-4b": 7680, "klein-9b": 12288}
"""Values per text token: three hidden layers of Mistral-Small-3.1 (5120), Qwen3-4B (2560), Qwen3-8B (4096)."""
REFERENCE_TIME = 10
"""The time coordinate step between reference images (`_prepare_image_ids`' `scale`): the image is at 0, its first
reference at 10, the next at 20."""


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, 4C, H/2, W/2]: each 2x2 patch's values as channels, as `Flux2Pipeline._patchify_latents`."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify`."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """Tandem's latents [B, C, H, W] -> the transformer's tokens [B, H/2 * W/2, 4C] (row by row)."""
    patches = patchify(latents)
    return patches.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack` for latents of `height` x `width`."""
    b, _, channels = tokens.shape
    return unpatchify(tokens.transpose(1, 2).reshape(b, channels, height // 2, width // 2))


def image_ids(height: int, width: int, device, dtype=torch.int64) -> torch.Tensor:
    """[H/2 * W/2, 4] position ids (0, row, column, 0) of the packed tokens, as `_prepare_latent_ids`."""
    rows, columns = torch.meshgrid(torch.arange(height // 2, device=device), torch.arange(width // 2, device=device),
                                   indexing="ij")
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros, rows, columns, zeros], dim=-1).reshape(-1, 4).to(dtype)


def text_ids(length: int, device, dtype=torch.int64) -> torch.Tensor:
    """[length, 4] position ids (0, 0, 0, token) of the text, as `_prepare_text_ids`."""
    ids = torch.zeros(length, 4, device=device, dtype=dtype)
    ids[:, 3] = torch.arange(length, device=device, dtype=dtype)
    return ids


def is_dev(transformer) -> bool:
    """Flux.2-dev takes the guidance value as an input; Klein does not."""
    return bool(transformer.config.get("guidance_embeds"))


def reference_ids(references: list[torch.Tensor], device) -> torch.Tensor:
    """[N, 4] position ids of reference latents (each [B, C, h, w]) packed one after the other: each at
    (REFERENCE_TIME * (1 + i), row, column, 0), as `Flux2Pipeline._prepare_image_ids` makes them."""
    parts = []
    for index, latents in enumerate(references):
        ids = image_ids(latents.shape[-2], latents.shape[-1], device)
        ids[:, 0] = REFERENCE_TIME * (1 + index)
        parts.append(ids)
    return torch.cat(parts)


class Flux2Objective(FluxObjective):
    """Flux's objective (dev's guidance input, `is_dev`) with Flux.2's packing and position ids; reference images
    (`controls`) join the image's tokens as the pipelines' `image=` does."""

    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None,
                controls=None):
        """The image's prediction; with controls [B, K, C, h, w], their tokens after its own, each reference at its
        own time offset, and the prediction its tokens only."""
        _, _, height, width = noisy.shape
        hidden = text["encoder_hidden_states"]
        tokens, ids = pack(noisy), image_ids(height, width, noisy.device)
        count = tokens.shape[1]
        if controls is not None:
            references = list(controls.to(noisy.dtype).unbind(1))
            tokens = torch.cat([tokens, *(pack(r) for r in references)], dim=1)
            ids = torch.cat([ids, reference_ids(references, noisy.device)])
        out = denoiser(hidden_states=tokens, encoder_hidden_states=hidden, timestep=timesteps,
                       guidance=self.guidance_input(noisy), img_ids=ids,
                       txt_ids=text_ids(hidden.shape[1], noisy.device), return_dict=False)[0]
        return unpack(out[:, :count], height, width)


class PatchBatchNormLatents:
    """Latents of Flux.2's VAE (`AutoencoderKLFlux2`), kept in its shape [B, 32, H/8, W/8], each value normalised by
    its 2x2 patch channel's batch-norm statistics as the pipelines normalise the packed latents (Flux.2, Flux.3):
    mixed in before the family's base class."""

    def normalize_latents(self, bundle, latents, spread=False):
        mean, std = self._batch_norm(bundle, latents)
        patches = patchify(latents)
        return unpatchify(patches / std if spread else (patches - mean) / std)

    def denormalize_latents(self, bundle, latents):
        mean, std = self._batch_norm(bundle, latents)
        return unpatchify(patchify(latents) * std + mean)

    @staticmethod
    def _batch_norm(bundle, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per patch-channel mean and standard deviation, as the pipeline applies them."""
        vae = bundle.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def load_vae(self, path, dtype, config=None):
        raise ValueError(f"model.vae_path {str(path)!r} is a single file; {self.info.title}'s VAE (AutoencoderKLFlux2, "
                         "with its latent statistics) loads from a diffusers folder: point model.vae_path at a VAE "
                         f"folder or at a {self.info.title} model folder that has vae/")


class Flux2Family(PatchBatchNormLatents, FlowFamily):
    transformer_class = "Flux2Transformer2DModel"
    vae_class = "AutoencoderKLFlux2"
    clip_classes = ()
    file_prefix = ""
    kohya_version = "flux2"
    kohya_implementation = IMPLEMENTATION_FLUX2

    def variant(self, bundle) -> str:
        """`dev` or `klein-4b` / `klein-9b` (by the text encoder's width; `klein` for other sizes)."""
        if is_dev(bundle.denoiser):
            return "dev"
        width = bundle.denoiser.config.get("joint_attention_dim")
        return next((name for name, value in TEXT_WIDTH.items() if value == width), "klein")

    def modelspec_architecture(self, bundle) -> str:
        return f"flux-2-{self.variant(bundle)}"  # as sd-scripts names Flux.1: flux-1-dev

    # ------------------------------------------------------------------ loading

    def component_names(self):
        return ["text_encoder"]

    def _assemble(self, transformer, folder, model_cfg, dtypes, source_name, own_vae):
        import transformers
        from diffusers import FlowMatchEulerDiscreteScheduler
        from transformers import AutoTokenizer

        from modules.model.bundle import ModelBundle

        self._check_files(folder, ["scheduler/scheduler_config.json"])
        vae = self._load_flow_vae(folder, model_cfg, dtypes, own_vae)
        common = {"local_files_only": True}
        config = json.loads((folder / "text_encoder" / "config.json").read_text(encoding="utf-8"))
        cls = getattr(transformers, (config.get("architectures") or ["AutoModelForCausalLM"])[0])
        # The language model never trains: its storage dtype is always the configured one (dev's is 48 GB in bf16).
        encoder = cls.from_pretrained(folder, subfolder="text_encoder", dtype=SAVE_DTYPES[model_cfg.text_encoder_dtype],
                                      **common, variant=component_variant(folder / "text_encoder", "text_encoder",
                                                                          model_cfg.text_encoder_dtype))
        # The text tokenizer alone (dev's folder holds a Pixtral processor, which needs torchvision for its
        # image half; the chat template and the tokens are the tokenizer's).
        tokenizer = AutoTokenizer.from_pretrained(folder, subfolder="tokenizer", **common)
        _with_chat_template(tokenizer, folder / "tokenizer")
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler", **common)
        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8")) \
            if (folder / "model_index.json").is_file() else {}
        return ModelBundle(
            model_type=self.name, denoiser=transformer, vae=vae, text_encoders=[encoder], tokenizers=[tokenizer],
            noise_scheduler=scheduler, prediction_type=FLOW_MATCHING, source=source_name,
            extra={"scheduler": scheduler, "text_lengths": [model_cfg.text_max_length or TEXT_LENGTH],
                   "is_distilled": bool(index.get("is_distilled", False))})

    # ------------------------------------------------------------------ text

    def encode_text(self, bundle, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """`encoder_hidden_states` [B, 512, 3 x the language model's width], as the pipeline encodes it."""
        from diffusers import Flux2KleinPipeline, Flux2Pipeline

        encoder, tokenizer = bundle.text_encoders[0], bundle.tokenizers[0]
        common = {"prompt": list(captions), "dtype": _dtype_of(encoder), "device": _device_of(encoder),
                  "max_sequence_length": bundle.text_lengths()[0]}
        if is_dev(bundle.denoiser):
            hidden = Flux2Pipeline._get_mistral_3_small_prompt_embeds(encoder, tokenizer, **common)
        else:
            hidden = Flux2KleinPipeline._get_qwen3_prompt_embeds(encoder, tokenizer, **common)
        return {"encoder_hidden_states": hidden}

    def text_encoder_blocks(self, encoder):
        model = getattr(encoder, "model", encoder)
        layers = getattr(getattr(model, "language_model", model), "layers", None)
        return list(layers) if layers is not None else []

    # ------------------------------------------------------------------ training, sampling

    def objective(self, bundle, training_cfg=None):
        return Flux2Objective(bundle, training_cfg)

    def pipeline(self, bundle):
        parts = {"scheduler": self.sampling_scheduler(bundle), "vae": bundle.vae, "text_encoder": bundle.text_encoders[0],
                 "tokenizer": bundle.tokenizers[0], "transformer": bundle.denoiser}
        if is_dev(bundle.denoiser):
            return _sized_pipeline_class("Flux2Pipeline")(**parts)
        return _sized_pipeline_class(KLEIN)(**parts, is_distilled=bool(bundle.extra.get("is_distilled")))

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        # dev: the guidance value is an input of the model, no negative prompt. Klein: classifier-free guidance
        # against the negative prompt (the pipeline's own is empty). The prompt's reference images, if any, are
        # cropped to the sample's size by the pipeline (`_sized_pipeline_class`).
        arguments = {"prompt": prompt.prompt, "guidance_scale": guidance_scale,
                     "max_sequence_length": bundle.text_lengths()[0]}
        references = sample_controls(prompt.control)
        if references:
            arguments["image"] = [reference.path for reference in references]
        if not is_dev(bundle.denoiser) and prompt.negative_prompt:
            arguments["negative_prompt_embeds"] = self.encode_text(bundle, [prompt.negative_prompt])["encoder_hidden_states"]
        return arguments

    def model_index_extras(self, bundle):
        if is_dev(bundle.denoiser):
            return {}
        return {"_class_name": KLEIN, "is_distilled": bool(bundle.extra.get("is_distilled"))}

    def cached_shapes(self, variant: str = "dev"):
        """512 tokens of three hidden layers of the variant's language model; 32 latent channels."""
        return 32, {"encoder_hidden_states": (TEXT_LENGTH, TEXT_WIDTH[_known(variant)])}

    def build_demo(self, root=None):
        from .dit_demo import ensure_dit_demo

        return ensure_dit_demo("flux2", root)

    # ------------------------------------------------------------------ single files

    def layout(self, config, keys):
        return layout.keep_present(flux2_entries(config["num_layers"], config["num_single_layers"]), keys)

    def shipped_transformer_config(self, state, variant: str = "dev"):
        """The variant's published config; for a file, the block counts, widths and guidance input its
        tensors show (`state`, may be empty)."""
        config = shipped("flux2", "transformer" if _known(variant) == "dev" else f"transformer_{variant}")
        if not state:
            return config
        return {**config, **bfl_widths(state, config),
                "timestep_guidance_channels": state["time_in.in_layer.weight"].shape[1],
                "guidance_embeds": any(k.startswith("guidance_in.") for k in state)}

    def owns_key(self, key):
        return not key.startswith(("vae.", "first_stage_model.", "text_encoders."))

    # ------------------------------------------------------------------ real-size random models

    def random_bundle(self, device, denoiser_dtype, variant: str = "dev"):
        """The variant's real-size transformer (built on `device` in `denoiser_dtype`), an uninitialised
        real-size VAE and a tiny stand-in language model: the benchmark's cache holds real-size embeddings."""
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler

        from modules.model.bundle import ModelBundle

        from .dit_demo import flux2_text_encoder
        from .sd import uninitialised

        variant = _known(variant)
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(denoiser_dtype)
        try:
            with torch.device(device):
                transformer = diffusers.Flux2Transformer2DModel.from_config(self.shipped_transformer_config({}, variant))
        finally:
            torch.set_default_dtype(default)
        transformer.requires_grad_(False)
        vae = uninitialised(lambda: diffusers.AutoencoderKLFlux2.from_config(shipped("flux2", "vae")))
        encoder, tokenizer = flux2_text_encoder(dev=variant == "dev")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(shipped("flux2", "scheduler"))
        return ModelBundle(model_type=self.name, denoiser=transformer, vae=vae, text_encoders=[encoder],
                           tokenizers=[tokenizer], noise_scheduler=scheduler, prediction_type=FLOW_MATCHING,
                           source=f"benchmark:random-flux2-{variant}",
                           extra={"scheduler": scheduler, "text_lengths": [TEXT_LENGTH]})

    def write_random_model(self, folder, dtype=None, device="cpu", variant: str = "dev"):
        """The variant at its real size with random weights, written one part at a time (dev's transformer
        and text encoder are 64 and 48 GB in bf16: never both in memory). The tokenizer is the demo's small
        one with the variant's chat template (its ids fit the real vocabulary; the weights are random anyway)."""
        import diffusers
        import transformers
        from diffusers import FlowMatchEulerDiscreteScheduler

        from modules.model.saving import write_model_index
        from modules.util.atomic import atomic_directory

        from .dit_demo import flux2_tokenizer

        variant, dtype, folder = _known(variant), dtype or torch.bfloat16, Path(folder)
        dev = variant == "dev"
        with atomic_directory(folder, replace=True) as temp:
            components = {}  # name -> class, for model_index.json (the built parts are freed one by one)

            def save(name, build):
                torch.manual_seed(0)
                default = torch.get_default_dtype()
                torch.set_default_dtype(dtype)
                try:
                    with torch.device(device):
                        module = build()
                finally:
                    torch.set_default_dtype(default)
                module.save_pretrained(temp / name, safe_serialization=True)
                components[name] = type(module)

            save("transformer", lambda: diffusers.Flux2Transformer2DModel.from_config(
                self.shipped_transformer_config({}, variant)))
            save("vae", lambda: diffusers.AutoencoderKLFlux2.from_config(shipped("flux2", "vae")))
            config = {k: v for k, v in shipped("flux2", "text_encoder" if dev else f"text_encoder_{variant}").items()
                      if not k.startswith("_")}
            cls = getattr(transformers, config["architectures"][0])
            save("text_encoder", lambda: cls(cls.config_class(**config)))
            tokenizer = flux2_tokenizer(dev)
            tokenizer.save_pretrained(temp / "tokenizer")
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(shipped("flux2", "scheduler"))
            scheduler.save_pretrained(temp / "scheduler")
            write_model_index(temp, self.info.pipeline_class if dev else KLEIN,
                              {**components, "scheduler": scheduler, "tokenizer": tokenizer},
                              {} if dev else {"is_distilled": False})
        return folder


@functools.cache
def _sized_pipeline_class(name: str):
    """Diffusers' Flux.2 pipeline `name` taking reference images as paths (`image=`), each cropped to the sample's
    size, as training crops a control to its image's bucket (the stock pipelines keep a reference's own size, shrunk
    to 1 megapixel when larger)."""
    import diffusers

    from modules.data.controls import control_picture

    class SizedFlux2Pipeline(getattr(diffusers, name)):
        def __call__(self, *args, image=None, height=None, width=None, **kwargs):
            if image is not None:
                image = [control_picture(path, width, height) for path in image]
            return super().__call__(*args, image=image, height=height, width=width, **kwargs)

    SizedFlux2Pipeline.__name__ = SizedFlux2Pipeline.__qualname__ = f"Sized{name}"
    return SizedFlux2Pipeline


def _with_chat_template(tokenizer, folder: Path) -> None:
    """Give the tokenizer the folder's chat template when it did not pick one up itself (a processor's folder
    may keep it beside the processor's files, `chat_template.jinja` or `chat_template.json`)."""
    if getattr(tokenizer, "chat_template", None):
        return
    if (folder / "chat_template.jinja").is_file():
        tokenizer.chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        tokenizer.chat_template = json.loads((folder / "chat_template.json").read_text(encoding="utf-8"))["chat_template"]
    else:
        raise ValueError(f"{folder}: the tokenizer has no chat template (tokenizer_config.json, chat_template.jinja "
                         "or chat_template.json), which Flux.2's prompts are written with; copy the tokenizer folder "
                         "of the Flux.2 model this one comes from")


def _known(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"Flux.2 has no variant {variant!r}; use one of {', '.join(VARIANTS)}")
    return variant


def flux2_entries(num_layers: int, num_single_layers: int) -> list[layout.Entry]:
    """Every module of a Flux.2 transformer, diffusers <-> Black Forest Labs names (the reverse of diffusers'
    `convert_flux2_transformer_checkpoint_to_diffusers`); `keep_present` drops Klein's missing guidance input.
    No Flux.2 layer has a bias; q, k and v are fused in the double blocks only (the single blocks' fused
    projections are one layer in diffusers too)."""
    E = layout.Entry
    entries = [
        E("img_in", ("x_embedder",)),
        E("txt_in", ("context_embedder",)),
        *bfl_embedder("time_in", "time_guidance_embed.timestep_embedder"),
        *bfl_embedder("guidance_in", "time_guidance_embed.guidance_embedder"),
        E("double_stream_modulation_img.lin", ("double_stream_modulation_img.linear",)),
        E("double_stream_modulation_txt.lin", ("double_stream_modulation_txt.linear",)),
        E("single_stream_modulation.lin", ("single_stream_modulation.linear",)),
        *bfl_final_layer(),
    ]
    for i in range(num_layers):
        entries += bfl_double_block(f"double_blocks.{i}", f"transformer_blocks.{i}", "linear_in", "linear_out")
    for i in range(num_single_layers):
        o, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        entries += [
            E(f"{o}.linear1", (f"{d}.attn.to_qkv_mlp_proj",)),
            E(f"{o}.linear2", (f"{d}.attn.to_out",)),
            *bfl_single_norms(o, d),
        ]
    return entries
