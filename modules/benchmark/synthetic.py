"""Random-weight SD-size models and synthetic cached latents for benchmarking the real trainer.

Only the data source and the model's origin are synthetic; the loop, DDP, optimizer, precision and
noise draw are the trainer's own. Everything is "cached" (latents and text embeddings), as in a real
run with caching on, so the VAE and text encoders are never run: they are built with uninitialised
CPU storage (shapes are real, values are not) instead of paying for random initialisation.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

from modules.model.single_file import shipped_config

TEXT_DIMS = {"sd1": 768, "sd2": 1024, "sdxl": 2048}


def _uninitialised(build):
    with torch.device("meta"):
        module = build()
    return module.to_empty(device="cpu").requires_grad_(False).eval()


def random_bundle(model_type: str, device: torch.device, unet_dtype: torch.dtype = torch.float32):
    """A ModelBundle with a randomly initialised real-size UNet (built directly on `device`).

    `unet_dtype` is the storage dtype `load_model` would give it (bf16 for a LoRA base, see
    `modules.model.loading.frozen_dtypes`)."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from modules.model.bundle import ModelBundle
    from modules.model.tokenizer import OPEN_CLIP_PAD_TOKEN, clip_tokenizer

    torch.manual_seed(0)
    with torch.device(device):
        unet = UNet2DConditionModel.from_config(shipped_config(model_type, "unet"))
    unet.requires_grad_(False).to(unet_dtype)
    vae = _uninitialised(lambda: AutoencoderKL.from_config(shipped_config(model_type, "vae")))
    te_configs = ["text_encoder"] + (["text_encoder_2"] if model_type == "sdxl" else [])
    encoders, tokenizers = [], []
    for name in te_configs:
        cfg = CLIPTextConfig(**{k: v for k, v in shipped_config(model_type, name).items() if not k.startswith("_")})
        cls = CLIPTextModelWithProjection if name == "text_encoder_2" else CLIPTextModel
        encoders.append(_uninitialised(lambda: cls(cfg)))
        tokenizers.append(clip_tokenizer(OPEN_CLIP_PAD_TOKEN if (model_type == "sd2" or name == "text_encoder_2")
                                         else "<|endoftext|>"))
    scheduler = DDPMScheduler.from_config(shipped_config(model_type, "scheduler"))
    return ModelBundle(model_type=model_type, unet=unet, vae=vae, text_encoders=encoders, tokenizers=tokenizers,
                       noise_scheduler=scheduler, prediction_type="epsilon", source=f"benchmark:random-{model_type}")


class SyntheticCachedLatents(Dataset):
    """Items shaped like the trainer's cached items: latents, text embeddings and SDXL sizes.

    A small pool of random tensors is reused by index, so item creation costs nothing measurable.
    """

    def __init__(self, model_type: str, resolution: int, length: int, pool: int = 16) -> None:
        gen = torch.Generator().manual_seed(0)
        lat = resolution // 8
        dim = TEXT_DIMS[model_type]
        self.length = length
        self.resolution = resolution
        self.latents = torch.randn(pool, 4, lat, lat, generator=gen)
        self.hidden = torch.randn(pool, 77, dim, generator=gen)
        self.pooled = torch.randn(pool, 1280, generator=gen) if model_type == "sdxl" else None
        self.buckets = [0] * length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key) -> dict:
        index = key[1] if isinstance(key, tuple) else key
        i = index % self.latents.shape[0]
        text = {"encoder_hidden_states": self.hidden[i]}
        if self.pooled is not None:
            text["pooled"] = self.pooled[i]
        size = (self.resolution, self.resolution)
        return {"index": index, "latents": self.latents[i], "text": text, "caption": "",
                "original_size": size, "crop_coords": (0, 0), "target_size": size}


def write_random_model(model_type: str, folder, dtype: torch.dtype = torch.float16):
    """A complete diffusers folder of a real-size model with random weights (for GPU checks offline).

    Unlike `random_bundle`, every part is properly initialised, so the VAE and text encoders can run.
    """
    from pathlib import Path

    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from modules.model.bundle import ModelBundle
    from modules.model.saving import save_full_diffusers
    from modules.model.tokenizer import OPEN_CLIP_PAD_TOKEN, clip_tokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config(shipped_config(model_type, "unet"))
    vae = AutoencoderKL.from_config(shipped_config(model_type, "vae"))
    encoders, tokenizers = [], []
    for name in ["text_encoder"] + (["text_encoder_2"] if model_type == "sdxl" else []):
        cfg = CLIPTextConfig(**{k: v for k, v in shipped_config(model_type, name).items() if not k.startswith("_")})
        encoders.append((CLIPTextModelWithProjection if name == "text_encoder_2" else CLIPTextModel)(cfg))
        tokenizers.append(clip_tokenizer(OPEN_CLIP_PAD_TOKEN if (model_type == "sd2" or name == "text_encoder_2")
                                         else "<|endoftext|>"))
    scheduler = DDPMScheduler.from_config(shipped_config(model_type, "scheduler"))
    bundle = ModelBundle(model_type=model_type, unet=unet, vae=vae, text_encoders=encoders, tokenizers=tokenizers,
                         noise_scheduler=scheduler, prediction_type="epsilon", source=f"random-{model_type}")
    save_full_diffusers(bundle, Path(folder), dtype)
    return Path(folder)
