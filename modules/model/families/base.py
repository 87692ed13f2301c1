"""`ModelFamily`: everything that differs between model families, behind one interface.

The trainer, the distributed layer, the cache and the GUI never ask which family a model is: they
call the bundle's family (`bundle.family`), which knows how its models are

- **loaded** (`load_folder`, `load_single_file`, `load_vae`, `build_demo`),
- **conditioned** (`encode_text`, which text encoders may train and which of their layers are dead ends),
- **trained** (`objective`: noise and timesteps for the global batch, the noisy input, the target, the
  loss, and how the denoiser is called - packing, position ids, guidance input),
- **sampled** (`pipeline` and `pipeline_arguments`: the stock diffusers pipeline),
- **saved** (`single_file_parts`, the diffusers folder's `model_index.json`, the kohya LoRA layout).

One module per family implements it: `sd.py` (SD 1.x/2.x), `sdxl.py`, `sd3.py`, `flux.py`, `chroma.py`,
`flux2.py`. Their static
facts (name, pipeline class, image-size step, the config fields they use) are in
`modules/families/registry.py`, where code that must not import torch reads them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from modules.families.registry import FAMILIES, FamilyInfo
from modules.model.objective import weighted_mean

if TYPE_CHECKING:  # pragma: no cover
    from modules.config.train_config import ModelConfig, TrainingConfig
    from modules.model.bundle import ModelBundle
    from modules.util.batch_slice import BatchSlice


class Objective(ABC):
    """How one family trains: the random draw for the global batch, the noisy input, the target, the
    loss, and the denoiser's forward. Built once per run (`ModelFamily.objective`)."""

    @abstractmethod
    def draw(self, latent_shape: tuple[int, ...], seed: int, step: int, micro: int, part: "BatchSlice",
             device: torch.device, offset_noise: float = 0.0):
        """This rank's part (`modules/util/batch_slice.py`) of the noise and timesteps drawn for the whole
        global batch, keyed by (seed, step, micro), so N ranks x B compute what 1 rank x N*B does."""

    @abstractmethod
    def noisy(self, latents: torch.Tensor, draw) -> torch.Tensor:
        """The denoiser's input."""

    @abstractmethod
    def target(self, latents: torch.Tensor, draw) -> torch.Tensor:
        """What the denoiser is trained to output, in the latents' shape."""

    @abstractmethod
    def per_sample_loss(self, prediction: torch.Tensor, target: torch.Tensor, draw,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B] each sample's loss; `mask`: [B, 1, H, W] loss weights at latent resolution (`data.masks`)."""

    def loss(self, prediction: torch.Tensor, target: torch.Tensor, draw, mask: torch.Tensor | None = None,
             weights: torch.Tensor | None = None) -> torch.Tensor:
        """The micro-batch's loss: the mean of each sample's loss x its `weights` entry (concepts' loss weights)."""
        return weighted_mean(self.per_sample_loss(prediction, target, draw, mask), weights)

    @abstractmethod
    def predict(self, denoiser, noisy: torch.Tensor, timesteps: torch.Tensor, text: dict[str, torch.Tensor],
                original_sizes=None, crop_coords=None, target_sizes=None) -> torch.Tensor:
        """The denoiser's output for `noisy` in the latents' shape; `denoiser` is the module (or its
        compiled form) to call."""


class ModelFamily(ABC):
    """One model family. Instances are stateless: every method takes the bundle it works on."""

    info: FamilyInfo

    def __init__(self, name: str) -> None:
        self.info = FAMILIES[name]

    @property
    def name(self) -> str:
        return self.info.name

    # ------------------------------------------------------------------ detection

    def recognise_folder(self, folder: Path, index: dict) -> str | None:
        """Why the diffusers folder (its `model_index.json` as `index`) is this family's, or None."""
        return None

    def recognise_checkpoint(self, keys: set[str]) -> str | None:
        """Why a single file with these tensor names is this family's (its `key_markers`), or None."""
        markers = self.info.key_markers
        found = next((key for key in keys if markers and key.startswith(markers)), None)
        return f"it has {found.rsplit('.', 2)[0]}.* weights" if found else None

    # ------------------------------------------------------------------ loading

    @abstractmethod
    def load_folder(self, folder: Path, model_cfg: "ModelConfig", dtypes: dict, source_name: str,
                    own_vae: bool) -> "ModelBundle":
        """A bundle from a diffusers folder (`own_vae=False`: leave `vae` None, another replaces it)."""

    @abstractmethod
    def load_single_file(self, path: Path, model_cfg: "ModelConfig", dtypes: dict, own_vae: bool) -> "ModelBundle":
        """A bundle from a single-file checkpoint in the family's original layout."""

    @abstractmethod
    def load_vae(self, path: Path, dtype: torch.dtype, config: dict | None = None):
        """A VAE from a single file (`model.vae_path`), with this family's latent scaling; `config`: fields
        from `model.config_overrides["vae"]` for a file whose sizes are not the standard ones."""

    # ------------------------------------------------------------------ latents (a 2-D VAE's, by default)

    def encode_images(self, bundle: "ModelBundle", pixels: torch.Tensor,
                      generator: torch.Generator | None = None) -> torch.Tensor:
        """Pixels in [-1, 1], [B, 3, H, W] -> a sample of the normalised latents [B, C, H/8, W/8]."""
        distribution = self._latent_distribution(bundle, pixels)
        return self.normalize_latents(bundle, distribution.sample(generator=generator))

    def encode_latent_distribution(self, bundle: "ModelBundle", pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the normalised latents (what the latent cache stores)."""
        distribution = self._latent_distribution(bundle, pixels)
        return (self.normalize_latents(bundle, distribution.mean),
                self.normalize_latents(bundle, distribution.std, spread=True))

    def decode_latents(self, bundle: "ModelBundle", latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> pixels in [-1, 1]. A family whose VAE takes other shapes (Qwen-Image's: video
        frames) overrides these three."""
        vae_param = next(bundle.vae.parameters())
        latents = self.denormalize_latents(bundle, latents.to(device=vae_param.device, dtype=vae_param.dtype))
        return bundle.vae.decode(latents).sample.clamp(-1, 1)

    def _latent_distribution(self, bundle: "ModelBundle", pixels: torch.Tensor):
        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"encode_images expects pixels of shape [B, 3, H, W], got {tuple(pixels.shape)}")
        vae_param = next(bundle.vae.parameters())
        pixels = pixels.to(device=vae_param.device, dtype=vae_param.dtype)
        return bundle.vae.encode(pixels).latent_dist

    def latent_scale(self, variant: str = "") -> int:
        """How many pixels of each side one latent pixel stands for in the published size `variant` (8; the Wan 2.2
        VAE's 16): what the benchmark's synthetic latents are sized by."""
        return 8

    def latent_frames(self, frames: int) -> int | None:
        """Latent frames of a clip of `frames` video frames; None: the family's latents have no frame axis."""
        return None

    def build_demo(self, root: Path | None = None) -> Path:
        """The built-in tiny model's diffusers folder, built on first use."""
        raise ValueError(f"{self.info.title} has no built-in demo model")

    # ------------------------------------------------------------------ latents

    def normalize_latents(self, bundle: "ModelBundle", latents: torch.Tensor, spread: bool = False) -> torch.Tensor:
        """The VAE's latents [B, C, H/8, W/8] in the units the denoiser trains on (most families: minus the
        VAE's `shift_factor`, times its `scaling_factor`); `spread`: `latents` is a posterior's standard
        deviation, which only scales. The result keeps the VAE latents' shape, so masks, buckets and the
        cache treat every family alike."""
        config = bundle.vae.config
        shift = getattr(config, "shift_factor", None)
        if shift is not None and not spread:
            latents = latents - shift
        return latents * config.scaling_factor

    def denormalize_latents(self, bundle: "ModelBundle", latents: torch.Tensor) -> torch.Tensor:
        """The inverse of `normalize_latents`: what the VAE decodes."""
        config = bundle.vae.config
        latents = latents / config.scaling_factor
        shift = getattr(config, "shift_factor", None)
        return latents + shift if shift is not None else latents

    # ------------------------------------------------------------------ text

    @abstractmethod
    def encode_text(self, bundle: "ModelBundle", captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Text conditioning, named tensors with the batch first (what the text cache stores)."""

    def trainable_text_encoders(self, bundle: "ModelBundle") -> list[nn.Module]:
        """The text encoders `training.train_text_encoder` trains."""
        return list(bundle.text_encoders)

    def checked_clip_skip(self, clip_skip: int) -> int:
        """`training.clip_skip` as this family accepts it; families whose conditioning is not CLIP's alone
        refuse any value (the SD families override this)."""
        raise ValueError(f"training.clip_skip: {clip_skip} does not apply to {self.info.title}, whose conditioning "
                         "is not CLIP's alone; set it to 0.")

    def unused_text_encoder_modules(self, bundle: "ModelBundle") -> list[nn.Module]:
        """Parts of the trained text encoders whose output never reaches the conditioning."""
        return []

    def unused_denoiser_parts(self, bundle: "ModelBundle") -> list[nn.Module | nn.Parameter]:
        """Modules (or parameters) of the denoiser whose output never reaches its prediction, at every step or at
        some: a last block's outputs that only a next block would read (Qwen-Image's text stream), padding
        embeddings some image sizes never use (Z-Image's). tests/integration/test_family_training.py finds any a family
        leaves out here."""
        return []

    def unused_modules(self, bundle: "ModelBundle") -> list[nn.Module | nn.Parameter]:
        """Everything that trains nowhere: no gradient reaches it, so training freezes it - a LoRA's adapters in
        it too -, or DistributedDataParallel would wait for its gradients and stop the run."""
        return [*self.unused_text_encoder_modules(bundle), *self.unused_denoiser_parts(bundle)]

    def added_cond(self, bundle: "ModelBundle", text, original_sizes, crop_coords, target_sizes):
        """Extra conditioning besides the text (SDXL's size and crop "time ids"); None for most families."""
        return None

    # ------------------------------------------------------------------ training

    @abstractmethod
    def objective(self, bundle: "ModelBundle", training_cfg: "TrainingConfig | None" = None) -> Objective:
        """The training objective for this bundle and training config."""

    def check_image_sizes(self, sizes: Sequence[tuple[int, int]], bundle: "ModelBundle | None" = None) -> None:
        """Refuse bucket sizes (width, height) the model cannot take (Flux packs 2x2 latent patches: 16 px),
        naming the settings to change. Validation does this when the config names the family; a model
        found by `auto` is checked here, once it is loaded (`bundle`: for a family whose step differs between
        its models, Wan 2.2 TI2V 5B's 32 px)."""
        step = self.info.pixel_multiple
        bad = [f"{w}x{h}" for w, h in sizes if w % step or h % step]
        if bad:
            raise ValueError(
                f"{self.info.title} takes images whose sides are multiples of {step} px, but the buckets include "
                f"{', '.join(bad[:4])}; set data.resolution and data.bucket_step to multiples of {step}")

    def check_clips(self, clips: Sequence[Path], video_frames: int) -> None:
        """Refuse video clips in the data of a family that trains images only (a video family: a clip length
        it cannot take), naming the clips and the fix."""
        if clips:
            shown = ", ".join(str(c) for c in clips[:3]) + (f" and {len(clips) - 3} more" if len(clips) > 3 else "")
            video = ", ".join(info.title for info in FAMILIES.values() if info.video)
            raise ValueError(f"{self.info.title} trains images only, but the concept folders hold {len(clips)} video "
                             f"clip(s): {shown}; move them out of the concepts, or train a video model ({video})")

    # ------------------------------------------------------------------ sharding

    @abstractmethod
    def repeated_blocks(self, bundle: "ModelBundle") -> list[nn.Module]:
        """The denoiser's repeated blocks. Sharded training (FSDP) shards each one as
        a unit - gathered whole just before it runs, freed after - and gradient checkpointing under FSDP
        recomputes each one; whatever lies outside them stays in the whole model's own unit."""

    def text_encoder_blocks(self, encoder: nn.Module) -> list[nn.Module]:
        """The repeated layers of a text encoder that trains (CLIP's `text_model.encoder.layers`)."""
        text_model = getattr(encoder, "text_model", encoder)
        layers = getattr(getattr(text_model, "encoder", None), "layers", None)
        return list(layers) if layers is not None else []

    # ------------------------------------------------------------------ sampling

    @abstractmethod
    def pipeline(self, bundle: "ModelBundle"):
        """The stock diffusers pipeline around the bundle's own modules."""

    def stock_pipeline(self, folder: Path):
        """The family's diffusers pipeline as `from_pretrained` reads the diffusers `folder`: what a user of diffusers
        loads (the tests compare Tandem's outputs with it). Qwen-Image 2.1's stands its tokenizer in for the
        processor, which needs torchvision."""
        import diffusers

        return getattr(diffusers, self.info.pipeline_class).from_pretrained(folder, local_files_only=True)

    samples_from_embeddings = False
    """Whether `pipeline_arguments` hands the pipeline the texts' embeddings kept from the start
    (`modules/model/sample_texts.py`) where they are there, so a sampling leaves frozen text encoders in host memory."""

    def texts_for_samples(self, prompts, guidance_scale: float) -> list[str]:
        """Every text a sampling of `prompts` encodes (a family that samples from embeddings)."""
        return list(dict.fromkeys(prompt.prompt for prompt in prompts))

    def pipeline_arguments(self, bundle: "ModelBundle", prompt, guidance_scale: float) -> dict[str, Any]:
        """Keyword arguments of one pipeline call besides size, steps and generator."""
        return {"prompt": prompt.prompt, "negative_prompt": prompt.negative_prompt or None,
                "guidance_scale": guidance_scale}

    def video_arguments(self, frames: int) -> dict[str, Any]:
        """Pipeline arguments of a sample `frames` video frames long (`sampling.video_frames`, a video family's
        field): none for an image family, which renders one image whatever `frames`."""
        return {}

    def sample_frames(self, result) -> list:
        """The frames of a pipeline call's `result`: an image family's one image, a video family's clip."""
        return [result.images[0]]

    def sample_size_multiple(self, bundle: "ModelBundle") -> int:
        """Sample widths and heights are rounded down to a multiple of this."""
        return self.info.pixel_multiple

    # ------------------------------------------------------------------ saving

    def denoiser_folder(self, bundle: "ModelBundle") -> str:
        """The subfolder of a full diffusers save that holds the trained denoiser: its component name, except for
        a Wan 2.2 low-noise expert (`transformer_2`)."""
        return bundle.denoiser_name

    def model_index_extras(self, bundle: "ModelBundle") -> dict[str, Any]:
        """`model_index.json` entries besides the components (unused components, pipeline flags; a family
        with several pipelines names the bundle's in `_class_name`)."""
        return {}

    def write_extra_components(self, bundle: "ModelBundle", folder: Path) -> dict[str, list[str]]:
        """Write the components of a diffusers folder that are not among the bundle's modules (a text encoder
        loaded apart: copied from its source) into `folder`; returns their `model_index.json` entries."""
        return {}

    @abstractmethod
    def single_file_parts(self, bundle: "ModelBundle", denoiser_state_override: dict | None = None):
        """(parts, metadata) of one `.safetensors` in the layout the family's original checkpoints use: each
        part a module and how a piece of its state dict is named there (`streamed_save.FilePart`);
        `saving.save_full_single_file` writes them."""

    # ------------------------------------------------------------------ real-size random models

    @abstractmethod
    def random_bundle(self, device: torch.device, denoiser_dtype: torch.dtype) -> "ModelBundle":
        """A bundle with a randomly initialised real-size denoiser (built on `device`) for benchmarks: the
        VAE and text encoders are never run there (everything is "cached"), so they are stand-ins."""

    @abstractmethod
    def cached_shapes(self) -> tuple[int, dict[str, tuple[int, ...]]]:
        """(latent channels, {text tensor: shape per item}) of the real models' cache entries."""

    @abstractmethod
    def write_random_model(self, folder: Path, dtype: torch.dtype | None, device: str = "cpu") -> Path:
        """A complete real-size diffusers folder with random weights (for GPU checks without a download)."""

    # ------------------------------------------------------------------ saving, LoRA layout

    def kohya_lora_tensors(self, bundle: "ModelBundle", modules: dict[str, dict[str, torch.Tensor]],
                           alphas: dict[str, float]) -> dict[str, torch.Tensor]:
        """LoRA weights (peft layout, by component) in the kohya layout ComfyUI/A1111/Forge read."""
        raise ValueError(f"{self.info.title} LoRAs have no kohya layout; set save.lora_format to peft")

    def lycoris_module_name(self, bundle: "ModelBundle", component: str, module_path: str) -> str:
        """The kohya/LyCORIS name of one adapted module (`lycoris_layout.py`): `lora_transformer_` + the
        diffusers module path for a transformer (ComfyUI maps these onto its fused weights),
        `lora_te1_` / `lora_te2_` + the checkpoint path for CLIP text encoders. The SD families use kohya's
        own UNet names instead."""
        if component == bundle.denoiser_name:
            prefix = "lora_unet" if component == "unet" else "lora_transformer"
        else:
            prefix = f"lora_te{component.removeprefix('text_encoder').removeprefix('_') or '1'}"
        return f"{prefix}_{module_path.replace('.', '_')}"

    def kohya_names(self, bundle: "ModelBundle") -> dict[str, tuple[str, str]]:
        """kohya module name -> (component, module path) of a family whose kohya layout has names of its own that
        `modules/model/lora_reading.py` reads back (Wan's `diffusion_model.` + original names); empty for the
        others, whose kohya files are read by their prefixes."""
        return {}

    def kohya_metadata(self, bundle: "ModelBundle") -> dict[str, str]:
        """The kohya `ss_*` header entries that describe the base model (`ss_base_model_version`, ...)."""
        return {"ss_base_model_version": self.name}

    def checkpoint_implementation(self) -> str:
        """`modelspec.implementation` of the family's single files: whose names their layout uses (SD's LDM
        layout is Stability's generative-models)."""
        from modules.model.lora_metadata import IMPLEMENTATION_SGM

        return IMPLEMENTATION_SGM

    @abstractmethod
    def lora_modelspec(self, bundle: "ModelBundle", fmt: str) -> dict[str, str]:
        """`modelspec.architecture` (as sd-scripts names it, with `/lora`), `modelspec.implementation` (whose
        module names the file in layout `fmt` uses) and `modelspec.resolution` of a LoRA for this model."""
