"""Stable Diffusion 1.x and 2.x: a UNet, one CLIP text encoder, DDPM noise (epsilon or v-prediction).

Conditioning follows `StableDiffusionPipeline` exactly (the text encoder's last hidden state), so a
model trained here behaves the same in diffusers, ComfyUI and A1111. SDXL (`sdxl.py`) builds on this.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from modules.config.validation import parse_config_overrides
from modules.model.lora_metadata import IMPLEMENTATION_DIFFUSERS, IMPLEMENTATION_SGM
from modules.model.variants import component_variant
from modules.model.objective import NoiseDraw, diffusion_per_sample, draw_noise, training_target

from .base import ModelFamily, Objective

PREDICTION_TYPES = ("epsilon", "v_prediction")
# The UNet's cross-attention width is what tells the SD families apart (CLIP-L 768, OpenCLIP-H
# 1024, CLIP-L + OpenCLIP-bigG 2048).
_TYPE_BY_CROSS_ATTENTION_DIM = {768: "sd1", 1024: "sd2", 2048: "sdxl"}
REQUIRED_FOLDER_FILES = (
    "model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json",
    "scheduler/scheduler_config.json",
)
_KOHYA_BASE_VERSION = {"sd1": "sd_v1", "sd2": "sd_v2", "sdxl": "sdxl_base_v1-0"}


class NoisePrediction(Objective):
    """DDPM training: noise added by the model's noise schedule, target epsilon or v, optional min-SNR."""

    def __init__(self, scheduler, prediction_type: str, min_snr_gamma: float = 0.0, added_cond=None) -> None:
        self.scheduler = scheduler
        self.prediction_type = prediction_type
        self.min_snr_gamma = min_snr_gamma
        self.added_cond = added_cond

    def draw(self, latent_shape, seed, step, micro, part, device, offset_noise=0.0) -> NoiseDraw:
        return draw_noise(latent_shape, self.scheduler.config.num_train_timesteps, seed, step, micro, part,
                          device, offset_noise)

    def noisy(self, latents, draw):
        return self.scheduler.add_noise(latents, draw.noise, draw.timesteps)

    def target(self, latents, draw):
        return training_target(self.scheduler, latents, draw.noise, draw.timesteps, self.prediction_type)

    def per_sample_loss(self, prediction, target, draw, mask=None):
        return diffusion_per_sample(prediction, target, self.scheduler, draw.timesteps, self.prediction_type,
                              self.min_snr_gamma, mask)

    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None):
        added = self.added_cond(text, original_sizes, crop_coords, target_sizes) if self.added_cond else None
        return denoiser(noisy, timesteps, text["encoder_hidden_states"], added_cond_kwargs=added).sample


class SDFamily(ModelFamily):
    """SD 1.x (`sd1`) and 2.x (`sd2`); the two differ only in their text encoder and default target."""

    text_encoder_names = ("text_encoder",)

    # ------------------------------------------------------------------ detection

    def recognise_folder(self, folder: Path, index: dict) -> str | None:
        found = detect_sd_folder(folder, index)
        return found[1] if found and found[0] == self.name else None

    # ------------------------------------------------------------------ loading

    def load_folder(self, folder, model_cfg, dtypes, source_name, own_vae):
        import diffusers
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        for name in self.text_encoder_names:
            tokenizer_name = name.replace("text_encoder", "tokenizer")
            for relative in (f"{name}/config.json", tokenizer_name):
                if not (folder / relative).exists():
                    raise FileNotFoundError(
                        f"{folder} is not a complete {self.name.upper()} diffusers folder: {relative} is missing")
        common = {"local_files_only": True}
        # fp16-only downloads (`*.fp16.safetensors`) need `variant`; each part is checked on its own.
        variant = {name: component_variant(folder / name, name, storage)
                   for name, storage in [("unet", model_cfg.unet_dtype)]
                   + ([("vae", model_cfg.vae_dtype)] if own_vae else [])
                   + [(encoder, model_cfg.text_encoder_dtype) for encoder in self.text_encoder_names]}
        unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet", torch_dtype=dtypes["unet"],
                                                    variant=variant["unet"], **common)
        vae = None
        if own_vae:
            vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", torch_dtype=dtypes["vae"],
                                                variant=variant["vae"], **common)
        text_encoders, tokenizers = [], []
        for name in self.text_encoder_names:
            model_class = CLIPTextModelWithProjection if name == "text_encoder_2" else CLIPTextModel
            text_encoders.append(model_class.from_pretrained(folder, subfolder=name, dtype=dtypes["text_encoder"],
                                                             variant=variant[name], **common))
            tokenizers.append(CLIPTokenizer.from_pretrained(
                folder, subfolder=name.replace("text_encoder", "tokenizer"), **common))

        index = json.loads((folder / "model_index.json").read_text())
        scheduler_class_name = (index.get("scheduler") or [None, "DDPMScheduler"])[1]
        scheduler_class = getattr(diffusers, scheduler_class_name, diffusers.DDPMScheduler)
        scheduler = scheduler_class.from_pretrained(folder, subfolder="scheduler", **common)
        return self._assemble(unet, vae, text_encoders, tokenizers, scheduler, model_cfg, source_name, folder)

    def load_single_file(self, path, model_cfg, dtypes, own_vae):
        from modules.model.files import as_dtype
        from modules.model.single_file import load_single_file_components

        parts = load_single_file_components(
            path, model_type=model_cfg.model_type, prediction_type=model_cfg.prediction_type,
            config_overrides=parse_config_overrides(model_cfg.config_overrides), load_vae=own_vae)
        encoders = [parts["text_encoder"]] + ([parts["text_encoder_2"]] if parts.get("text_encoder_2") is not None else [])
        tokenizers = [parts["tokenizer"]] + ([parts["tokenizer_2"]] if parts.get("tokenizer_2") is not None else [])
        for encoder, tokenizer in zip(encoders, tokenizers):
            if len(tokenizer) > encoder.config.vocab_size:
                # A single file stores no tokenizer, so the standard CLIP one is used; a model with its
                # own smaller vocabulary (Tandem's demo model, for one) cannot be read this way.
                raise ValueError(
                    f"{path}: its text encoder knows {encoder.config.vocab_size} tokens but the standard CLIP "
                    f"tokenizer has {len(tokenizer)}; the model was trained with its own tokenizer. Load it "
                    "from its diffusers folder instead (save with save.full_format = diffusers)"
                )
        unet = as_dtype(parts["unet"], dtypes["unet"])
        vae = as_dtype(parts["vae"], dtypes["vae"]) if own_vae else None
        encoders = [as_dtype(encoder, dtypes["text_encoder"]) for encoder in encoders]
        scheduler = parts["scheduler"]
        if parts.get("prediction_type") in PREDICTION_TYPES and model_cfg.prediction_type == "auto":
            scheduler = type(scheduler).from_config(scheduler.config, prediction_type=parts["prediction_type"])
        return self._assemble(unet, vae, encoders, tokenizers, scheduler, model_cfg, str(path.resolve()), path)

    def load_vae(self, path, dtype, config=None):
        from modules.model.files import as_dtype
        from modules.model.single_file import load_vae_file

        return as_dtype(load_vae_file(path, model_type=self.name, config=config), dtype)

    def build_demo(self, root=None):
        from modules.model.demo import ensure_demo_model

        if not self.info.demo:
            return super().build_demo(root)
        return ensure_demo_model(root)

    def _assemble(self, unet, vae, text_encoders, tokenizers, scheduler, model_cfg, source_name, where):
        from diffusers import DDPMScheduler

        from modules.model.bundle import ModelBundle

        prediction_type = model_cfg.prediction_type
        if prediction_type == "auto":
            prediction_type = scheduler.config.get("prediction_type", "epsilon")
        if prediction_type not in PREDICTION_TYPES:
            raise ValueError(
                f"{where}: its scheduler's prediction_type is {prediction_type!r}, which Tandem cannot train; "
                f"set model.prediction_type to one of {', '.join(PREDICTION_TYPES)}"
            )
        # Sampling and saving keep the model's own scheduler (with the trained prediction type).
        scheduler = type(scheduler).from_config(scheduler.config, prediction_type=prediction_type)
        noise_scheduler = DDPMScheduler.from_config(scheduler.config, prediction_type=prediction_type)
        return ModelBundle(
            model_type=self.name, denoiser=unet, vae=vae, text_encoders=text_encoders, tokenizers=tokenizers,
            noise_scheduler=noise_scheduler, prediction_type=prediction_type, source=source_name,
            extra={"scheduler": scheduler},
        )

    # ------------------------------------------------------------------ text

    def encode_text(self, bundle, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """`encoder_hidden_states` [B, 77, D]: the text encoder's last hidden state, or with
        `training.clip_skip` N >= 2 the N-th from the end through CLIP's final norm (as kohya and diffusers'
        `clip_skip` compute it)."""
        encoder = bundle.text_encoders[0]
        ids = bundle.tokenize(captions)[0].to(_device_of(encoder))
        skip = bundle.extra.get("clip_skip", 0)
        if skip < 2:
            return {"encoder_hidden_states": encoder(ids, output_hidden_states=False)[0]}
        output = encoder(ids, output_hidden_states=True)
        inner = getattr(encoder, "text_model", encoder)
        return {"encoder_hidden_states": inner.final_layer_norm(output.hidden_states[-skip])}

    def checked_clip_skip(self, clip_skip: int) -> int:
        return clip_skip

    def unused_text_encoder_modules(self, bundle):
        """With clip skip N >= 2 the last N - 1 CLIP layers never reach the conditioning: training freezes
        them, or DistributedDataParallel waits for their gradients."""
        skip = bundle.extra.get("clip_skip", 0)
        if skip < 2:
            return []
        inner = getattr(bundle.text_encoders[0], "text_model", bundle.text_encoders[0])
        return list(inner.encoder.layers[-(skip - 1):])

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        """With clip skip the prompts are encoded here, as training encodes captions: the pipeline's own
        `clip_skip` reaches for CLIP's `text_model` wrapper, which transformers 5 no longer has, and leaves
        the negative prompt at the last layer."""
        if bundle.extra.get("clip_skip", 0) < 2:
            return super().pipeline_arguments(bundle, prompt, guidance_scale)
        with torch.no_grad():
            positive = self.encode_text(bundle, [prompt.prompt])["encoder_hidden_states"]
            negative = self.encode_text(bundle, [prompt.negative_prompt or ""])["encoder_hidden_states"]
        return {"prompt_embeds": positive, "negative_prompt_embeds": negative, "guidance_scale": guidance_scale}

    def diffusers_clip_skip(self, clip_skip: int) -> int:
        """`training.clip_skip` as diffusers' `clip_skip` argument, which counts the layers skipped
        (1: the penultimate), one less than kohya's; 0: none."""
        return max(0, clip_skip - 1)

    # ------------------------------------------------------------------ training

    def objective(self, bundle, training_cfg=None) -> NoisePrediction:
        gamma = training_cfg.min_snr_gamma if training_cfg is not None else 0.0
        added_cond = (lambda text, sizes, crops, targets: self.added_cond(bundle, text, sizes, crops, targets))
        return NoisePrediction(bundle.noise_scheduler, bundle.prediction_type, gamma, added_cond)

    # ------------------------------------------------------------------ sampling

    def pipeline(self, bundle):
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline(
            vae=bundle.vae, text_encoder=bundle.text_encoders[0], tokenizer=bundle.tokenizers[0],
            unet=bundle.unet, scheduler=self.sampling_scheduler(bundle), safety_checker=None,
            feature_extractor=None, requires_safety_checker=False,
        )

    def sampling_scheduler(self, bundle):
        from diffusers import DDIMScheduler

        base = bundle.extra.get("scheduler", bundle.noise_scheduler)
        # DDIM is deterministic for a given seed and good at few steps; "trailing" spacing reaches the
        # last training timestep, which matters for v-prediction and zero-terminal-SNR models.
        return DDIMScheduler.from_config(
            base.config, prediction_type=bundle.prediction_type, timestep_spacing="trailing", clip_sample=False,
        )

    def sample_size_multiple(self, bundle) -> int:
        vae_factor = 2 ** (len(bundle.vae.config.block_out_channels) - 1)
        return vae_factor * 2 ** (len(bundle.unet.config.block_out_channels) - 1)

    # ------------------------------------------------------------------ sharding

    def repeated_blocks(self, bundle):
        """Every ResNet block and every transformer block of the UNet: the units diffusers' own gradient
        checkpointing recomputes, so checkpointing under FSDP keeps the same activations as under DDP."""
        from diffusers.models.attention import BasicTransformerBlock
        from diffusers.models.resnet import ResnetBlock2D

        return [m for m in bundle.unet.modules() if isinstance(m, (ResnetBlock2D, BasicTransformerBlock))]

    # ------------------------------------------------------------------ saving

    def model_index_extras(self, bundle):
        return {"safety_checker": [None, None], "feature_extractor": [None, None], "image_encoder": [None, None],
                "requires_safety_checker": False}

    def single_file_parts(self, bundle, denoiser_state_override=None):
        from modules.model.single_file import single_file_parts

        return single_file_parts(bundle, denoiser_state_override)

    def lycoris_module_name(self, bundle, component, module_path):
        """kohya's names, as for plain LoRA (`kohya_lora.kohya_module_name`)."""
        from modules.model.kohya_lora import kohya_module_name

        return kohya_module_name(bundle.model_type, component, module_path, bundle.unet.config)

    def kohya_lora_tensors(self, bundle, modules, alphas):
        """kohya sd-scripts' names (`modules/model/kohya_lora.py`): SD1/SD2 in diffusers' module paths, SDXL's
        UNet in the original (LDM) ones, `.lora_down/.lora_up/.alpha`."""
        from modules.model.kohya_lora import kohya_tensors

        return kohya_tensors(bundle, modules, alphas)

    def lora_modelspec(self, bundle, fmt):
        v = bundle.prediction_type == "v_prediction"
        architecture = {"sd1": "stable-diffusion-v1",
                        "sd2": "stable-diffusion-v2-768-v" if v else "stable-diffusion-v2-512",
                        "sdxl": "stable-diffusion-xl-v1-base"}[self.name]
        # sd-scripts' SDXL LoRAs name the original (generative-models) UNet's modules; the rest diffusers'.
        implementation = IMPLEMENTATION_SGM if fmt == "kohya" and self.name == "sdxl" else IMPLEMENTATION_DIFFUSERS
        resolution = {"sd1": 512, "sd2": 768, "sdxl": 1024}[self.name]
        return {"modelspec.architecture": architecture + "/lora", "modelspec.implementation": implementation,
                "modelspec.resolution": f"{resolution}x{resolution}"}

    def kohya_metadata(self, bundle) -> dict[str, str]:
        return {"ss_base_model_version": _KOHYA_BASE_VERSION[self.name], "ss_v2": str(self.name == "sd2"),
                "ss_v_parameterization": str(bundle.prediction_type == "v_prediction")}


    # ------------------------------------------------------------------ real-size random models

    def cached_shapes(self):
        width = {"sd1": 768, "sd2": 1024, "sdxl": 2048}[self.name]
        text = {"encoder_hidden_states": (77, width)}
        if len(self.text_encoder_names) > 1:
            text["pooled"] = (1280,)
        return 4, text

    def _random_parts(self, build_text_encoder):
        """VAE config, text encoders (each made by `build_text_encoder(class, config)`) and tokenizers."""
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

        from modules.model.single_file import shipped_config
        from modules.model.tokenizer import EOS_TOKEN, OPEN_CLIP_PAD_TOKEN, clip_tokenizer

        encoders, tokenizers = [], []
        for name in self.text_encoder_names:
            config = CLIPTextConfig(**{k: v for k, v in shipped_config(self.name, name).items() if not k.startswith("_")})
            cls = CLIPTextModelWithProjection if name == "text_encoder_2" else CLIPTextModel
            encoders.append(build_text_encoder(cls, config))
            # OpenCLIP (SD 2.x, SDXL's second encoder) pads with "!", OpenAI CLIP with the end token.
            tokenizers.append(clip_tokenizer(OPEN_CLIP_PAD_TOKEN if self.name == "sd2" or name == "text_encoder_2"
                                             else EOS_TOKEN))
        return encoders, tokenizers

    def random_bundle(self, device, denoiser_dtype):
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

        from modules.model.bundle import ModelBundle
        from modules.model.single_file import shipped_config

        torch.manual_seed(0)
        # Built in its storage dtype, as the transformer families' are: built in fp32 and cast, a bf16 base first
        # held twice its size and spent the CPU time of initialising it in fp32 (per rank).
        default = torch.get_default_dtype()
        torch.set_default_dtype(denoiser_dtype)
        try:
            with torch.device(device):
                unet = UNet2DConditionModel.from_config(shipped_config(self.name, "unet"))
        finally:
            torch.set_default_dtype(default)
        unet.requires_grad_(False)
        vae = uninitialised(lambda: AutoencoderKL.from_config(shipped_config(self.name, "vae")))
        encoders, tokenizers = self._random_parts(lambda cls, config: uninitialised(lambda: cls(config)))
        return ModelBundle(model_type=self.name, denoiser=unet, vae=vae, text_encoders=encoders, tokenizers=tokenizers,
                           noise_scheduler=DDPMScheduler.from_config(shipped_config(self.name, "scheduler")),
                           prediction_type="epsilon", source=f"benchmark:random-{self.name}")

    def write_random_model(self, folder, dtype=None, device="cpu"):
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

        from modules.model.bundle import ModelBundle
        from modules.model.saving import save_full_diffusers
        from modules.model.single_file import shipped_config

        torch.manual_seed(0)
        unet = UNet2DConditionModel.from_config(shipped_config(self.name, "unet"))
        vae = AutoencoderKL.from_config(shipped_config(self.name, "vae"))
        encoders, tokenizers = self._random_parts(lambda cls, config: cls(config))
        bundle = ModelBundle(model_type=self.name, denoiser=unet, vae=vae, text_encoders=encoders,
                             tokenizers=tokenizers, noise_scheduler=DDPMScheduler.from_config(
                                 shipped_config(self.name, "scheduler")), prediction_type="epsilon",
                             source=f"random-{self.name}")
        return save_full_diffusers(bundle, Path(folder), dtype or torch.float16)


def uninitialised(build):
    """A module with real shapes and uninitialised CPU storage (for parts a benchmark never runs)."""
    with torch.device("meta"):
        module = build()
    return module.to_empty(device="cpu").requires_grad_(False).eval()


def detect_sd_folder(folder: Path, index: dict) -> tuple[str, str] | None:
    """(model type, reason) for an SD 1.x/2.x/SDXL diffusers folder, None for other pipelines."""
    if not (folder / "unet").is_dir() or index.get("transformer"):
        return None
    if index.get("text_encoder_2") and index["text_encoder_2"][0] is not None:
        return "sdxl", "it has a text_encoder_2"
    unet_config = json.loads((folder / "unet" / "config.json").read_text())
    dim = unet_config.get("cross_attention_dim")
    if dim in _TYPE_BY_CROSS_ATTENTION_DIM:
        return _TYPE_BY_CROSS_ATTENTION_DIM[dim], f"its UNet cross_attention_dim is {dim}"
    # Small research/demo models with one text encoder: the encoder's activation tells OpenCLIP (SD 2.x,
    # gelu) from OpenAI CLIP (SD 1.x, quick_gelu), as the two families' own folders record it.
    encoder_config = json.loads((folder / "text_encoder" / "config.json").read_text())
    if encoder_config.get("hidden_act") == "gelu":
        return "sd2", f"its one text encoder is OpenCLIP-style (gelu; UNet cross_attention_dim {dim})"
    return "sd1", f"it has one text encoder (UNet cross_attention_dim {dim})"


def _device_of(module) -> torch.device:
    return next(module.parameters()).device
