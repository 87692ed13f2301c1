"""What SD3 and Flux share: a transformer trained with rectified flow, CLIP + T5 text encoders,
diffusers folders and single files whose missing parts come from a components folder.

- **Objective** (`FlowMatching`): noisy = (1 - t) x0 + t noise, target noise - x0, plain MSE; t is
  logit-normal and then shifted exactly as the model's own flow-match scheduler shifts it when
  sampling (SD3: a fixed shift of 3; Flux.1-dev: by image size, `use_dynamic_shifting`), so training
  spends its steps where sampling does.
- **Text**: the CLIP encoders and T5 run as the pipelines run them, without attention masks (the
  pipelines use none, so the transformer learns the padded T5 sequence it will see). T5 is never
  trained; cached text embeddings let it leave the GPU (`trainer/caching.offload_cached_encoders`).
- **Single files** hold the transformer (SD3.5's also the VAE); the text encoders, tokenizers and
  scheduler come from `model.components_folder`, a diffusers folder of the same family.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from modules.model.files import SAVE_DTYPES
from modules.model.lora_metadata import IMPLEMENTATION_DIFFUSERS, IMPLEMENTATION_SGM
from modules.model.variants import component_variant
from modules.model.objective import NoiseDraw, draw_flow_noise, flow_noisy, flow_per_sample, flow_shift, shift_times

from . import original_layout as layout
from .base import ModelFamily, Objective

FLOW_MATCHING = "flow_matching"
"""`bundle.prediction_type` of the flow families: the transformer predicts the velocity noise - x0."""
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
WRAPPED_PREFIX = "model.diffusion_model."
META_MODEL_TYPE = "tandem.model_type"
META_CONFIGS = "tandem.configs"


class FlowMatching(Objective):
    """Rectified-flow training; the family's subclass says how its transformer is called."""

    def __init__(self, bundle, training_cfg=None) -> None:
        self.scheduler_config = dict(bundle.noise_scheduler.config)
        self.logit_mean = training_cfg.timestep_logit_mean if training_cfg is not None else 0.0
        self.logit_std = training_cfg.timestep_logit_std if training_cfg is not None else 1.0

    def image_tokens(self, latent_shape: tuple[int, ...]) -> int:
        """Tokens the transformer sees for latents of this shape (2x2 latent pixels per token)."""
        return latent_shape[-2] * latent_shape[-1] // 4

    def draw(self, latent_shape, seed, step, micro, part, device, offset_noise=0.0) -> NoiseDraw:
        draw = draw_flow_noise(latent_shape, seed, step, micro, part, device, offset_noise,
                               self.logit_mean, self.logit_std)
        shift = flow_shift(self.scheduler_config, self.image_tokens(latent_shape))
        return NoiseDraw(draw.noise, shift_times(draw.timesteps, shift))

    def noisy(self, latents, draw):
        return flow_noisy(latents, draw.noise, draw.timesteps)

    def target(self, latents, draw):
        return draw.noise - latents

    def per_sample_loss(self, prediction, target, draw, mask=None):
        return flow_per_sample(prediction, target, mask)


class FlowFamily(ModelFamily):
    """SD3 and Flux: the parts of loading, text encoding and saving that do not differ."""

    transformer_class = ""
    """The diffusers transformer class name."""
    vae_class = "AutoencoderKL"
    """The diffusers VAE class name."""
    clip_classes: tuple[str, ...] = ()
    """The transformers classes of the CLIP encoders, in pipeline order (T5 follows them)."""
    default_t5_length = 256
    file_prefix = ""
    """Prefix of the transformer's keys in the family's single files."""

    # ------------------------------------------------------------------ detection

    def recognise_folder(self, folder, index):
        if index.get("_class_name") in self.info.pipelines:
            return f"its model_index.json names {index['_class_name']}"
        if (index.get("transformer") or [None, None])[1] == self.transformer_class:
            return f"its transformer is a {self.transformer_class}"
        return None

    # ------------------------------------------------------------------ loading

    def component_names(self) -> list[str]:
        """The text encoders' diffusers component names: the CLIP encoders', then T5's."""
        return ["text_encoder"] + [f"text_encoder_{i + 2}" for i in range(len(self.clip_classes))]

    def load_folder(self, folder, model_cfg, dtypes, source_name, own_vae):
        import diffusers

        required = ["transformer/config.json", "scheduler/scheduler_config.json"]
        self._check_files(folder, required)
        transformer = getattr(diffusers, self.transformer_class).from_pretrained(
            folder, subfolder="transformer", torch_dtype=dtypes["unet"], local_files_only=True,
            variant=component_variant(folder / "transformer", "transformer", model_cfg.unet_dtype))
        return self._assemble(transformer, folder, model_cfg, dtypes, source_name, own_vae)

    def load_single_file(self, path, model_cfg, dtypes, own_vae):
        from modules.model.files import as_dtype
        from modules.model.single_file import read_checkpoint

        folder = self._components_folder(path, model_cfg)
        state, metadata = read_checkpoint(path)
        transformer = as_dtype(self.transformer_from_file(state, metadata, path), dtypes["unet"])
        vae = None
        if own_vae:
            vae = self.vae_from_file(state, metadata, path)
            vae = as_dtype(vae, dtypes["vae"]) if vae is not None else None
        del state
        bundle = self._assemble(transformer, folder, model_cfg, dtypes, str(path.resolve()),
                                own_vae and vae is None)
        bundle.extra["components_source"] = str(folder.resolve())  # the text encoders' origin (cache key)
        if vae is not None:
            bundle.vae = vae
        return bundle

    def _components_folder(self, path: Path, model_cfg) -> Path:
        """`model.components_folder`, checked: where a single file's text encoders, tokenizers and scheduler come from."""
        components = model_cfg.components_folder.strip()
        if not components:
            raise ValueError(
                f"{path} is a {self.info.title} single file, which holds the transformer but not the text "
                f"encoders, tokenizers and scheduler; set model.components_folder to a diffusers folder of "
                f"{self.info.title} (e.g. the one the file was fine-tuned from) to take them from there")
        folder = Path(components).expanduser()
        self._check_components_folder(folder)
        return folder

    def _check_components_folder(self, folder: Path) -> None:
        from . import detect_folder

        if not (folder / "model_index.json").is_file():
            raise FileNotFoundError(f"model.components_folder {str(folder)!r} is not a diffusers folder "
                                    "(no model_index.json); point it at one of the same family")
        found, reason = detect_folder(folder)
        if found != self.name:
            raise ValueError(f"model.components_folder {str(folder)!r} is a {found} folder ({reason}), but the "
                             f"base model is {self.info.title}; use a {self.name} diffusers folder")

    def _check_files(self, folder: Path, required: list[str]) -> None:
        """`required` and every component's config must be in the diffusers `folder`."""
        for relative in [*required, "vae/config.json", *(f"{n}/config.json" for n in self.component_names())]:
            if not (folder / relative).is_file():
                raise FileNotFoundError(
                    f"{folder} is not a complete {self.info.title} diffusers folder: {relative} is missing")

    def _assemble(self, transformer, folder: Path, model_cfg, dtypes, source_name: str, own_vae: bool):
        """The bundle around `transformer`, every other part read from the diffusers `folder`."""
        import transformers
        from diffusers import FlowMatchEulerDiscreteScheduler
        from transformers import AutoTokenizer

        from modules.model.bundle import ModelBundle

        self._check_files(folder, ["scheduler/scheduler_config.json"])
        vae = self._load_flow_vae(folder, model_cfg, dtypes, own_vae)
        common = {"local_files_only": True}
        encoders, tokenizers = [], []
        for index, name in enumerate(self.component_names()):
            is_t5 = index == len(self.clip_classes)
            cls = transformers.T5EncoderModel if is_t5 else getattr(transformers, self.clip_classes[index])
            # T5 never trains, so its storage dtype is always the configured one (fp32 T5-XXL is 19 GB).
            dtype = SAVE_DTYPES[model_cfg.text_encoder_dtype] if is_t5 else dtypes["text_encoder"]
            encoders.append(cls.from_pretrained(folder, subfolder=name, dtype=dtype, **common,
                                                variant=component_variant(folder / name, name, model_cfg.text_encoder_dtype)))
            tokenizers.append(AutoTokenizer.from_pretrained(folder, subfolder=name.replace("text_encoder", "tokenizer"),
                                                            **common))
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler", **common)
        t5_length = model_cfg.t5_max_length or self.t5_length_default(transformer)
        return ModelBundle(
            model_type=self.name, denoiser=transformer, vae=vae, text_encoders=encoders, tokenizers=tokenizers,
            noise_scheduler=scheduler, prediction_type=FLOW_MATCHING, source=source_name,
            extra={"scheduler": scheduler, "text_lengths": [77] * len(self.clip_classes) + [t5_length]},
        )

    def _load_flow_vae(self, folder: Path, model_cfg, dtypes, own_vae: bool):
        """The diffusers VAE from `folder/vae` (None when the run brings its own), after refusing a
        `model.prediction_type` other than auto: every flow family trains rectified flow only."""
        import diffusers

        if model_cfg.prediction_type != "auto":
            raise ValueError(f"model.prediction_type is {model_cfg.prediction_type!r}, but {self.info.title} "
                             "trains rectified flow; set model.prediction_type to auto")
        if not own_vae:
            return None
        return getattr(diffusers, self.vae_class).from_pretrained(
            folder, subfolder="vae", torch_dtype=dtypes["vae"], local_files_only=True,
            variant=component_variant(folder / "vae", "vae", model_cfg.vae_dtype))

    def t5_length_default(self, transformer) -> int:
        """T5 tokens per caption when `model.t5_max_length` is 0: the pipeline's default."""
        return self.default_t5_length

    def load_vae(self, path, dtype, config=None):
        from modules.model.files import as_dtype
        from modules.model.single_file import load_vae_file

        return as_dtype(load_vae_file(path, model_type=self.name, config=config), dtype)

    # ------------------------------------------------------------------ sharding

    def repeated_blocks(self, bundle):
        """The transformer's blocks, from the module lists `FamilyInfo.block_groups` names: SD3's joint blocks;
        Flux's double-stream, then single-stream blocks; Z-Image's refiners, then its layers."""
        transformer = bundle.denoiser
        return [block for group in self.info.block_groups for block in getattr(transformer, group, [])]

    # ------------------------------------------------------------------ single files

    def layout(self, config, keys: Sequence[str]) -> list[layout.Entry]:
        """The diffusers <-> original table of a transformer with this config and these weights."""
        raise NotImplementedError

    def transformer_from_file(self, state: dict, metadata: dict, path: Path):
        """The transformer of a single file (original layout), built on `meta` and loaded by assignment."""
        import diffusers

        from modules.model.single_file import _build, _load_weights

        # Stability's files and ComfyUI's saves put the transformer under `model.diffusion_model.`, BFL's not.
        prefix = WRAPPED_PREFIX if any(k.startswith(WRAPPED_PREFIX) for k in state) else ""
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix) and self.owns_key(k[len(prefix):])}
        config = self.transformer_config(own, metadata)
        model = _build(getattr(diffusers, self.transformer_class), config)
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        converted = layout.from_original(own, self.layout(config, shapes), shapes, source=str(path))
        return _load_weights(model, converted, path, "transformer")

    def owns_key(self, key: str) -> bool:
        """Whether a key (prefix removed) belongs to the transformer, not the VAE or a text encoder."""
        return True

    def transformer_config(self, state: dict, metadata: dict) -> dict:
        recorded = json.loads(metadata[META_CONFIGS]).get("transformer") if META_CONFIGS in metadata else None
        return recorded or self.shipped_transformer_config(state)

    def shipped_transformer_config(self, state: dict) -> dict:
        """The real-size config; the families adapt it to what a file's key names show (`state`, may be empty)."""
        return shipped(self.name, "transformer")

    def vae_from_file(self, state: dict, metadata: dict, path: Path):
        """The file's own VAE, or None when it has none (then the components folder's is used)."""
        return None

    def single_file_parts(self, bundle, denoiser_state_override=None):
        from modules.model.streamed_save import FilePart

        transformer = bundle.denoiser
        state = (lambda: dict(denoiser_state_override)) if denoiser_state_override is not None else transformer.state_dict
        entries = self.layout(transformer.config, list(state()))
        parts = [FilePart(transformer, state, lambda piece: layout.to_original(piece, entries, self.file_prefix),
                          tuple(self.repeated_blocks(bundle)))]
        configs = {"transformer": plain_config(transformer.config)}
        parts += self.extra_file_parts(bundle, configs)
        metadata = {"format": "pt", META_MODEL_TYPE: self.name, META_CONFIGS: json.dumps(configs)}
        return parts, metadata

    def extra_file_parts(self, bundle, configs: dict) -> list:
        """What the family's single files hold besides the transformer (SD3.5: the VAE), recording the
        configs of what they add in `configs`."""
        return []

    # ------------------------------------------------------------------ text

    def trainable_text_encoders(self, bundle):
        return list(bundle.text_encoders[:len(self.clip_classes)])  # T5 is never trained

    def encode_t5(self, bundle, ids: torch.Tensor) -> torch.Tensor:
        t5 = bundle.text_encoders[-1]
        return t5(ids.to(_device_of(t5)))[0].to(dtype=_dtype_of(t5))

    # ------------------------------------------------------------------ sampling

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        return {"prompt": prompt.prompt, "negative_prompt": prompt.negative_prompt or None,
                "guidance_scale": guidance_scale, "max_sequence_length": bundle.text_lengths()[-1]}

    def sampling_scheduler(self, bundle):
        from diffusers import FlowMatchEulerDiscreteScheduler

        base = bundle.extra.get("scheduler", bundle.noise_scheduler)
        return FlowMatchEulerDiscreteScheduler.from_config(base.config)

    # ------------------------------------------------------------------ LoRA

    kohya_version = ""
    """`ss_base_model_version` as kohya sd-scripts writes it for this family."""

    def kohya_metadata(self, bundle):
        return {"ss_base_model_version": self.kohya_version}

    kohya_implementation = IMPLEMENTATION_SGM
    """Whose module names the kohya layout uses: the original checkpoints' (Stability's; Flux: BFL's)."""

    def modelspec_architecture(self, bundle) -> str:
        return self.name

    def checkpoint_implementation(self) -> str:
        return self.kohya_implementation  # the single files and kohya LoRAs use the original release's names

    def lora_modelspec(self, bundle, fmt):
        return {"modelspec.architecture": self.modelspec_architecture(bundle) + "/lora",
                "modelspec.implementation": self.kohya_implementation if fmt == "kohya" else IMPLEMENTATION_DIFFUSERS,
                "modelspec.resolution": "1024x1024"}

    def kohya_lora_tensors(self, bundle, modules, alphas):
        """The transformer's adapters under the original module names, fused as the original weights are
        (`original_layout.lora_to_original`); CLIP adapters as `lora_te1_` / `lora_te2_` + their paths."""
        from modules.model.lora import lora_alpha_and_rank, split_peft_key

        tensors = {}
        for component, state in modules.items():
            alpha, rank = lora_alpha_and_rank(bundle, component)
            if component == bundle.denoiser_name:
                shapes = {k.replace(".base_layer", ""): v.shape for k, v in bundle.denoiser.state_dict().items()
                          if ".lora_" not in k}
                entries = self.layout(bundle.denoiser.config, shapes)
                tensors.update(layout.lora_to_original(state, entries, alpha / rank, shapes))
                continue
            prefix = f"lora_te{component.removeprefix('text_encoder').removeprefix('_') or '1'}"
            for key, value in state.items():
                module_path, kind = split_peft_key(key)
                name = f"{prefix}_{module_path.replace('.', '_')}"
                tensors[f"{name}.{'lora_down' if kind == 'lora_A' else 'lora_up'}.weight"] = value
                tensors[f"{name}.alpha"] = torch.tensor(alpha)
        return tensors


    # ------------------------------------------------------------------ real-size random models

    def random_bundle(self, device, denoiser_dtype):
        """The real-size transformer (built on `device` directly in `denoiser_dtype`: an fp32 Flux alone
        would take 48 GB first), a real-size uninitialised VAE, and tiny random text encoders: they are
        never run, the synthetic cache holds real-size text embeddings (`cached_shapes`)."""
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler

        from modules.model.bundle import ModelBundle

        from .dit_demo import demo_t5_tokenizer, tiny_clip, tiny_t5
        from .sd import uninitialised

        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(denoiser_dtype)
        try:
            with torch.device(device):
                transformer = getattr(diffusers, self.transformer_class).from_config(self.shipped_transformer_config({}))
        finally:
            torch.set_default_dtype(default)
        transformer.requires_grad_(False)
        vae = uninitialised(lambda: getattr(diffusers, self.vae_class).from_config(shipped(self.name, "vae")))
        from modules.model.tokenizer import clip_tokenizer

        clip = clip_tokenizer()
        t5_tokenizer = demo_t5_tokenizer()
        encoders = [tiny_clip(clip, i, cls == "CLIPTextModelWithProjection") for i, cls in enumerate(self.clip_classes)]
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(shipped(self.name, "scheduler"))
        return ModelBundle(
            model_type=self.name, denoiser=transformer, vae=vae, text_encoders=[*encoders, tiny_t5(t5_tokenizer, 0)],
            tokenizers=[clip] * len(self.clip_classes) + [t5_tokenizer], noise_scheduler=scheduler,
            prediction_type=FLOW_MATCHING, source=f"benchmark:random-{self.name}",
            extra={"scheduler": scheduler,
                   "text_lengths": [77] * len(self.clip_classes) + [self.t5_length_default(transformer)]})

    def write_random_model(self, folder, dtype=None, device="cpu"):
        """Every part at its real size (T5-XXL included) with random weights, built on `device` directly in
        `dtype` (bf16 by default), then saved tensor by tensor. The T5 tokenizer is the demo's small one
        (its ids fit T5's vocabulary; the weights are random anyway), the CLIP tokenizers are the real ones."""
        import diffusers
        import transformers
        from diffusers import FlowMatchEulerDiscreteScheduler

        from modules.model.bundle import ModelBundle
        from modules.model.saving import save_full_diffusers
        from modules.model.tokenizer import clip_tokenizer

        from .dit_demo import demo_t5_tokenizer

        dtype = dtype or torch.bfloat16
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                transformer = getattr(diffusers, self.transformer_class).from_config(self.shipped_transformer_config({}))
                vae = getattr(diffusers, self.vae_class).from_config(shipped(self.name, "vae"))
                encoders = []
                for name in self.component_names():
                    config = {k: v for k, v in shipped(self.name, name).items() if not k.startswith("_")}
                    cls = getattr(transformers, config["architectures"][0])
                    encoders.append(cls(cls.config_class(**config)))
        finally:
            torch.set_default_dtype(default)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(shipped(self.name, "scheduler"))
        bundle = ModelBundle(
            model_type=self.name, denoiser=transformer, vae=vae, text_encoders=encoders,
            tokenizers=[clip_tokenizer()] * len(self.clip_classes) + [demo_t5_tokenizer()], noise_scheduler=scheduler,
            prediction_type=FLOW_MATCHING, source=f"random-{self.name}", extra={"scheduler": scheduler})
        return save_full_diffusers(bundle, Path(folder), dtype)


def shipped(family: str, component: str) -> dict:
    """A real-size config shipped in `configs/<family>/<component>.json`."""
    path = CONFIG_DIR / family / f"{component}.json"
    if not path.is_file():
        raise ValueError(f"no shipped {component} config for {family} ({path})")
    return json.loads(path.read_text(encoding="utf-8"))


def plain_config(config) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(config).items() if not k.startswith("_")}


def _device_of(module) -> torch.device:
    return next(module.parameters()).device


def _dtype_of(module) -> torch.dtype:
    return next(module.parameters()).dtype


class ChannelNormalizedLatents:
    """Latents normalised per channel by the VAE's `latents_mean` and `latents_std` (Qwen-Image's and Wan's
    pipelines): mixed in before the family's base class."""

    def normalize_latents(self, bundle, latents, spread=False):
        """Per channel, as the pipeline: (latents - latents_mean) / latents_std."""
        mean, std = _channel_statistics(bundle, latents)
        return latents / std if spread else (latents - mean) / std

    def denormalize_latents(self, bundle, latents):
        mean, std = _channel_statistics(bundle, latents)
        return latents * std + mean


def _channel_statistics(bundle, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel latent mean and std, shaped [1, C, 1, ...] to broadcast over `like`."""
    config = bundle.vae.config
    shape = (1, config.z_dim) + (1,) * (like.ndim - 2)
    mean = torch.tensor(config.latents_mean, device=like.device, dtype=like.dtype).view(shape)
    std = torch.tensor(config.latents_std, device=like.device, dtype=like.dtype).view(shape)
    return mean, std
