"""`ModelBundle`: the parts of a Stable Diffusion model that training needs, and how to feed them.

The conditioning code follows the diffusers pipelines exactly (SD1/SD2: the text encoder's last
hidden state; SDXL: the penultimate hidden states of both encoders side by side, plus the second
encoder's pooled projection and the size/crop "time ids"), so that a model trained here behaves
the same in `StableDiffusionPipeline` / `StableDiffusionXLPipeline`, ComfyUI and the like.
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

MODEL_TYPES = ("sd1", "sd2", "sdxl")
# The parts of a diffusers folder whose weights shape the cached latents and text embeddings.
_CACHE_INPUT_FOLDERS = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


@dataclass
class ModelBundle:
    model_type: str
    """`sd1`, `sd2` or `sdxl`."""
    unet: Any
    """`UNet2DConditionModel`."""
    vae: Any
    """`AutoencoderKL`."""
    text_encoders: list
    """One CLIP text model (SD1/SD2) or two (SDXL: `CLIPTextModel`, `CLIPTextModelWithProjection`)."""
    tokenizers: list
    """One tokenizer per text encoder, in the same order."""
    noise_scheduler: Any
    """`DDPMScheduler` used to add noise during training."""
    prediction_type: str
    """`epsilon` or `v_prediction`: what the UNet is trained to predict."""
    source: str
    """What was loaded: `builtin:demo`, a folder or a single file (absolute path)."""
    vae_source: str = ""
    """Where the VAE came from when it overrides the model's own. Empty: the model's VAE."""
    extra: dict = field(default_factory=dict)
    """Loader notes kept for saving (e.g. the scheduler config of the original model)."""

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        if len(self.text_encoders) != len(self.tokenizers):
            raise ValueError("a ModelBundle needs exactly one tokenizer per text encoder")

    # ---------------------------------------------------------------- devices, modules

    @property
    def device(self) -> torch.device:
        return next(self.unet.parameters()).device

    def to(self, device: torch.device | str) -> "ModelBundle":
        """Move every module to `device` (dtypes unchanged) and return the bundle."""
        for module in self.modules().values():
            module.to(device)
        return self

    def modules(self) -> dict[str, nn.Module]:
        """The bundle's modules by their diffusers component name (`unet`, `vae`, `text_encoder`, `text_encoder_2`)."""
        found = {"unet": self.unet, "vae": self.vae}
        for index, encoder in enumerate(self.text_encoders):
            found[_text_encoder_name(index)] = encoder
        return found

    def trainable_modules(self) -> dict[str, nn.Module]:
        """The modules that hold at least one parameter with `requires_grad` (what an optimizer sees)."""
        return {
            name: module for name, module in self.modules().items()
            if any(p.requires_grad for p in module.parameters())
        }

    # ---------------------------------------------------------------- encoders

    def encode_images(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Encode images in [-1, 1], shape [B, 3, H, W], into scaled latents [B, C, H/8, W/8].

        Samples the VAE's latent distribution (as the diffusers training scripts do); the caller
        decides about `torch.no_grad()`. `generator` makes the sample reproducible.
        """
        vae = self.vae
        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"encode_images expects pixels of shape [B, 3, H, W], got {tuple(pixels.shape)}")
        vae_param = next(vae.parameters())
        pixels = pixels.to(device=vae_param.device, dtype=vae_param.dtype)
        latents = vae.encode(pixels).latent_dist.sample(generator=generator)
        shift = getattr(vae.config, "shift_factor", None)
        if shift is not None:
            latents = latents - shift
        return latents * vae.config.scaling_factor

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Inverse of `encode_images` (up to the VAE's quality): scaled latents -> pixels in [-1, 1]."""
        vae = self.vae
        vae_param = next(vae.parameters())
        latents = latents.to(device=vae_param.device, dtype=vae_param.dtype) / vae.config.scaling_factor
        shift = getattr(vae.config, "shift_factor", None)
        if shift is not None:
            latents = latents + shift
        return vae.decode(latents).sample.clamp(-1, 1)

    def tokenize(self, captions: Sequence[str]) -> list[torch.Tensor]:
        """Token ids [B, max_length] for each tokenizer, padded and truncated like the pipelines."""
        ids = []
        for tokenizer in self.tokenizers:
            ids.append(tokenizer(
                list(captions), padding="max_length", max_length=tokenizer.model_max_length,
                truncation=True, return_tensors="pt",
            ).input_ids)
        return ids

    def encode_text(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Text conditioning for `captions`.

        Returns `encoder_hidden_states` [B, 77, D] and, for SDXL, `pooled` [B, 1280]. Gradients flow
        when a text encoder is trained; wrap the call in `torch.no_grad()` otherwise.
        """
        if isinstance(captions, str):
            raise TypeError("encode_text expects a list of captions, not a single string")
        token_ids = self.tokenize(captions)
        if self.model_type != "sdxl":
            encoder = self.text_encoders[0]
            output = encoder(token_ids[0].to(_device_of(encoder)), output_hidden_states=False)
            return {"encoder_hidden_states": output[0]}

        hidden, pooled = [], None
        for encoder, ids in zip(self.text_encoders, token_ids):
            output = encoder(ids.to(_device_of(encoder)), output_hidden_states=True)
            # SDXL conditions on the penultimate layer of both encoders; the pooled vector comes
            # from the last one (the projection model), as in StableDiffusionXLPipeline.encode_prompt.
            hidden.append(output.hidden_states[-2])
            pooled = output[0]
        device = hidden[-1].device
        return {
            "encoder_hidden_states": torch.cat([h.to(device) for h in hidden], dim=-1),
            "pooled": pooled,
        }

    def unused_text_encoder_modules(self) -> list[nn.Module]:
        """Text-encoder parts whose output never reaches the conditioning, so they get no gradient.

        SDXL reads the first encoder's penultimate hidden states only: its last layer and final norm
        are dead ends. Training must freeze them, or DistributedDataParallel waits for their gradients.
        """
        if self.model_type != "sdxl":
            return []
        inner = getattr(self.text_encoders[0], "text_model", self.text_encoders[0])
        return [inner.encoder.layers[-1], inner.final_layer_norm]

    def added_cond(
        self,
        text: dict[str, torch.Tensor],
        original_sizes: Sequence[Sequence[int]],
        crop_coords: Sequence[Sequence[int]],
        target_sizes: Sequence[Sequence[int]],
    ) -> dict[str, torch.Tensor] | None:
        """SDXL's `added_cond_kwargs` for the UNet (`text_embeds`, `time_ids` [B, 6]); None for SD1/SD2.

        Sizes and crop coordinates are (height, width) and (top, left), one per sample, as SDXL
        was trained with.
        """
        if self.model_type != "sdxl":
            return None
        pooled = text["pooled"]
        rows = [
            [*map(int, original), *map(int, crop), *map(int, target)]
            for original, crop, target in zip(original_sizes, crop_coords, target_sizes, strict=True)
        ]
        if len(rows) != pooled.shape[0]:
            raise ValueError(f"added_cond got {len(rows)} size entries for a batch of {pooled.shape[0]}")
        time_ids = torch.tensor(rows, dtype=pooled.dtype)
        if pooled.is_cuda:  # a copy from pageable memory would make the CPU wait for the GPU
            time_ids = time_ids.pin_memory()
        time_ids = time_ids.to(pooled.device, non_blocking=True)
        return {"text_embeds": pooled, "time_ids": time_ids}

    # ---------------------------------------------------------------- identity

    def fingerprint(self) -> str:
        """A stable hash of what the latent and text caches depend on, used as their cache key.

        Covers the model source (path plus size/modification time of the weight files that feed the
        caches), the model type, the VAE in use, and the storage dtypes of the VAE and text encoders.
        """
        description = {
            "source": _source_identity(self.source, _CACHE_INPUT_FOLDERS),
            "model_type": self.model_type,
            "vae": _source_identity(self.vae_source, ()) if self.vae_source else "model",
            "vae_config": _plain_config(self.vae.config),
            "vae_dtype": str(next(self.vae.parameters()).dtype),
            "text_encoder_dtypes": [str(next(e.parameters()).dtype) for e in self.text_encoders],
        }
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


def _text_encoder_name(index: int) -> str:
    return "text_encoder" if index == 0 else f"text_encoder_{index + 1}"


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _plain_config(config) -> dict:
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


def _source_identity(source: str, subfolders: Sequence[str]) -> Any:
    """Path plus size and mtime of its weight files, so that replacing a model invalidates caches."""
    if source.startswith("builtin:"):
        from .demo import DEMO_MODEL_VERSION

        return f"{source}@{DEMO_MODEL_VERSION}"
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
