"""`ModelBundle`: the parts of a diffusion model that training needs, and how to feed them.

The bundle holds the modules; what differs between model families (text encoding, conditioning,
the objective, sampling, saving) is asked of `bundle.family` (`modules/model/families/`), so code
that handles a bundle never needs to know which family it is. Each family follows its diffusers
pipeline exactly, so that a model trained here behaves the same in diffusers, ComfyUI and the like.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from modules.families.registry import FAMILIES, MODEL_TYPES

# The parts of a diffusers folder whose weights shape the cached latents and text embeddings.
_CACHE_INPUT_FOLDERS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2",
                        "tokenizer_3")


@dataclass
class ModelBundle:
    model_type: str
    """The family: `sd1`, `sd2`, `sdxl`, `sd3`, `flux`, `qwen` or `zimage` (see `modules/families/registry.py`)."""
    denoiser: Any
    """The trained network: `UNet2DConditionModel` (SD families) or the family's transformer (SD3, Flux)."""
    vae: Any
    """`AutoencoderKL`."""
    text_encoders: list
    """The text encoders in the pipeline's order: CLIP (SD1/SD2), CLIP-L + OpenCLIP-bigG (SDXL),
    CLIP-L + CLIP-G + T5-XXL (SD3), CLIP-L + T5-XXL (Flux); none for Qwen-Image and Z-Image, whose text
    encoder is loaded apart (`extra["text_side"]`, modules/model/text_apart.py)."""
    tokenizers: list
    """One tokenizer per text encoder, in the same order."""
    noise_scheduler: Any
    """The scheduler whose noise schedule training follows (`DDPMScheduler`, or the flow-matching one)."""
    prediction_type: str
    """`epsilon` or `v_prediction` (SD families), `flow_matching` (SD3, Flux): what the denoiser predicts."""
    source: str
    """What was loaded: a `builtin:` name, a folder or a single file (absolute path)."""
    vae_source: str = ""
    """Where the VAE came from when it overrides the model's own. Empty: the model's VAE."""
    extra: dict = field(default_factory=dict)
    """Loader notes kept for sampling and saving (e.g. the model's own scheduler, the T5 length)."""

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        if len(self.text_encoders) != len(self.tokenizers):
            raise ValueError("a ModelBundle needs exactly one tokenizer per text encoder")

    @property
    def family(self):
        """The `ModelFamily` that knows how this bundle is conditioned, trained, sampled and saved."""
        from modules.model.families import family

        return family(self.model_type)

    @property
    def unet(self):
        """The denoiser under its SD name (the SD families' code and files call it the UNet)."""
        return self.denoiser

    @unet.setter
    def unet(self, module) -> None:
        self.denoiser = module

    @property
    def denoiser_name(self) -> str:
        """The denoiser's diffusers component name: `unet` or `transformer`."""
        return FAMILIES[self.model_type].denoiser

    # ---------------------------------------------------------------- devices, modules

    @property
    def device(self) -> torch.device:
        return next(self.denoiser.parameters()).device

    def to(self, device: torch.device | str) -> "ModelBundle":
        """Move every module to `device` (dtypes unchanged) and return the bundle."""
        for module in self.modules().values():
            module.to(device)
        return self

    def modules(self) -> dict[str, nn.Module]:
        """The bundle's modules by their diffusers component name (`unet` or `transformer`, `vae`,
        `text_encoder`, `text_encoder_2`, `text_encoder_3`)."""
        found = {self.denoiser_name: self.denoiser, "vae": self.vae}
        for index, encoder in enumerate(self.text_encoders):
            found[text_encoder_name(index)] = encoder
        return found

    def sampling_modules(self) -> dict[str, nn.Module]:
        """What sampling runs: the bundle's modules and those loaded for samples alone (`extra["frozen_modules"]`:
        the frozen expert of a Wan 2.2 A14B run, kept in host memory while training)."""
        frozen = {f"frozen {name}": module for name, module in self.extra.get("frozen_modules", {}).items()}
        return {**self.modules(), **frozen}

    def trainable_modules(self) -> dict[str, nn.Module]:
        """The modules that hold at least one parameter with `requires_grad` (what an optimizer sees)."""
        return {
            name: module for name, module in self.modules().items()
            if any(p.requires_grad for p in module.parameters())
        }

    def trainable_text_encoders(self) -> list[nn.Module]:
        """The text encoders `training.train_text_encoder` trains (never T5)."""
        return self.family.trainable_text_encoders(self)

    # ---------------------------------------------------------------- encoders

    def encode_images(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Encode images in [-1, 1], shape [B, 3, H, W], into scaled latents [B, C, H/8, W/8].

        Samples the VAE's latent distribution (as the diffusers training scripts do); the caller
        decides about `torch.no_grad()`. `generator` makes the sample reproducible. How latents are
        scaled is the family's (`ModelFamily.encode_images`).
        """
        return self.family.encode_images(self, pixels, generator)

    def encode_latent_distribution(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the scaled latents of images in [-1, 1], [B, 3, H, W]: `encode_images` draws
        `mean + std * noise`. The latent cache stores these, so that each use of an image draws its own
        sample from a generator keyed by the seed and the item alone (see modules/data/cache.py)."""
        return self.family.encode_latent_distribution(self, pixels)

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Inverse of `encode_images` (up to the VAE's quality): scaled latents -> pixels in [-1, 1]."""
        return self.family.decode_latents(self, latents)

    def tokenize(self, captions: Sequence[str]) -> list[torch.Tensor]:
        """Token ids [B, length] for each tokenizer, padded and truncated like the pipelines."""
        return [tokenizer(list(captions), padding="max_length", max_length=length, truncation=True,
                          return_tensors="pt").input_ids
                for tokenizer, length in zip(self.tokenizers, self.text_lengths(), strict=True)]

    def text_lengths(self) -> list[int]:
        """Tokens per caption for each tokenizer: CLIP's 77, or the T5 length the family chose
        (`extra["text_lengths"]`, set when loading SD3 and Flux)."""
        return list(self.extra.get("text_lengths") or [t.model_max_length for t in self.tokenizers])

    def encode_text(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Text conditioning for `captions`, as the family's pipeline computes it.

        SD1/SD2: `encoder_hidden_states` [B, 77, D]; SDXL adds `pooled` [B, 1280]; SD3 and Flux: the
        joint text sequence and the pooled CLIP vector (see their family modules). Gradients flow
        when a text encoder is trained; wrap the call in `torch.no_grad()` otherwise.
        """
        if isinstance(captions, str):
            raise TypeError("encode_text expects a list of captions, not a single string")
        return self.family.encode_text(self, captions)

    def unused_text_encoder_modules(self) -> list[nn.Module]:
        """Text-encoder parts whose output never reaches the conditioning, so they get no gradient.

        Training must freeze them, or DistributedDataParallel waits for their gradients (SDXL: the
        first encoder's last layer and final norm).
        """
        return self.family.unused_text_encoder_modules(self)

    def unused_modules(self) -> list[nn.Module | nn.Parameter]:
        """Every trainable part whose output never reaches the loss (the text encoders' dead ends and the
        denoiser's, `ModelFamily.unused_modules`): training freezes them."""
        return self.family.unused_modules(self)

    def added_cond(
        self,
        text: dict[str, torch.Tensor],
        original_sizes: Sequence[Sequence[int]],
        crop_coords: Sequence[Sequence[int]],
        target_sizes: Sequence[Sequence[int]],
    ) -> dict[str, torch.Tensor] | None:
        """SDXL's `added_cond_kwargs` for the UNet (`text_embeds`, `time_ids` [B, 6]); None for other families.

        Sizes and crop coordinates are (height, width) and (top, left), one per sample, as SDXL
        was trained with.
        """
        return self.family.added_cond(self, text, original_sizes, crop_coords, target_sizes)

    # ---------------------------------------------------------------- identity

    def fingerprint(self) -> str:
        """A stable hash of what the latent and text caches depend on, used as their cache key.

        Covers the model source (path plus size/modification time of the weight files that feed the
        caches), the model type, the VAE in use, and the storage dtypes of the VAE and text encoders;
        for SD3 and Flux also the folder the text encoders came from (`model.components_folder`) and
        the text lengths (`model.t5_max_length` changes the embeddings' shape).
        """
        description = {
            "source": _source_identity(self.source, _CACHE_INPUT_FOLDERS),
            "model_type": self.model_type,
            "vae": _source_identity(self.vae_source, ()) if self.vae_source else "model",
            "vae_config": _plain_config(self.vae.config),
            "vae_dtype": str(next(self.vae.parameters()).dtype),
            "text_encoder_dtypes": [str(next(e.parameters()).dtype) for e in self.text_encoders],
        }
        if "text_lengths" in self.extra:  # SD keys stay as they were, so SD caches stay valid
            description["text_lengths"] = self.text_lengths()
        if self.extra.get("clip_skip"):  # another CLIP layer: other embeddings (absent by default: caches stay valid)
            description["clip_skip"] = self.extra["clip_skip"]
        if "text_side" in self.extra:  # an encoder loaded apart (text_apart.py): its dtype, not loaded weights
            description["text_side"] = self.extra["text_side"].describe()
        if self.extra.get("components_source"):
            description["components"] = _source_identity(self.extra["components_source"], _CACHE_INPUT_FOLDERS)
        blob = json.dumps(description, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def checkpoint_text_encoder_key(key: str) -> str:
    """A CLIP text-encoder weight/module name as checkpoints spell it.

    transformers 5 dropped CLIP's `text_model.` wrapper module; checkpoints, kohya files, older
    diffusers LoRAs and transformers 4 all keep it, so saved names put it back (transformers 5
    maps it away again when loading).
    """
    if key.startswith(("encoder.", "embeddings.", "final_layer_norm.")):
        return "text_model." + key
    return key


def text_encoder_name(index: int) -> str:
    """The diffusers component name of the text encoder at `index`: `text_encoder`, `text_encoder_2`, ..."""
    return "text_encoder" if index == 0 else f"text_encoder_{index + 1}"


def _plain_config(config) -> dict:
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


def _source_identity(source: str, subfolders: Sequence[str]) -> Any:
    """Path plus size and mtime of its weight files, so that replacing a model invalidates caches."""
    if source.startswith("builtin:"):
        from .demo import DEMO_MODEL_VERSION

        return f"{source}@{DEMO_MODEL_VERSION}"  # one version number for every built-in model
    path = Path(source)
    if path.is_file():
        stat = path.stat()
        return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]
    if path.is_dir():
        files = []
        roots = [path / sub for sub in subfolders if (path / sub).is_dir()] or [path]
        for root in roots:
            for file in sorted(root.iterdir()):
                if file.is_file():
                    stat = file.stat()
                    files.append([os.path.relpath(file, path), stat.st_size, stat.st_mtime_ns])
        return [str(path.resolve()), files]
    return source
