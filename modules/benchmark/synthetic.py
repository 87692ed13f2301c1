"""Random-weight real-size models and synthetic cached latents for benchmarking the real trainer.

Only the data source and the model's origin are synthetic; the loop, DDP, optimizer, precision and
noise draw are the trainer's own. Everything is "cached" (latents and text embeddings), as in a real
run with caching on, so the VAE and text encoders are never run: the family builds them as cheap
stand-ins (`family.random_bundle`) and says what real cache entries hold (`family.cached_shapes`).
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

from modules.benchmark import DEMO
from modules.model.families import family


def _variant(variant: str) -> dict:
    """The keyword a family with several published sizes takes (families of one size take none)."""
    return {"variant": variant} if variant else {}


def _demo_shapes(model_type: str) -> tuple[int, dict[str, tuple[int, ...]], int]:
    """(latent channels, {text tensor: shape per item}, pixels per latent pixel) of the family's built-in
    tiny model, read from its folder's configs."""
    import json

    folder = family(model_type).build_demo()
    unet = json.loads((folder / "unet" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    return unet["in_channels"], {"encoder_hidden_states": (77, unet["cross_attention_dim"])}, \
        2 ** (len(vae["block_out_channels"]) - 1)


def random_bundle(model_type: str, device: torch.device, unet_dtype: torch.dtype = torch.float32, variant: str = ""):
    """A ModelBundle with a randomly initialised real-size UNet or transformer (built directly on `device`).

    `unet_dtype` is the storage dtype `load_model` would give it (bf16 for a LoRA base, see
    `modules.model.loading.frozen_dtypes`); `variant` one of the family's sizes (`FamilyInfo.variants`)."""
    return family(model_type).random_bundle(device, unet_dtype, **_variant(variant))


def control_count(model_type: str, asked: int | None) -> int:
    """Control images per item: `asked`, checked against the family (ValueError naming --controls and the fix),
    or by default one where the family needs controls and none where they are optional or not taken."""
    from modules.families.registry import FAMILIES

    info = FAMILIES.get(model_type)
    takes = info is not None and bool(info.controls)
    if asked is None:
        return 1 if takes and not info.controls_optional else 0
    if asked < 0:
        raise ValueError(f"--controls {asked}: give a count of control images, 0 or more")
    if asked and not takes:
        raise ValueError(f"--controls {asked}: {model_type} trains on plain images, not on control images; leave "
                         "--controls out or pick an edit model (the families whose controls are named in "
                         "docs/Models.md)")
    if asked and info.max_controls and asked > info.max_controls:
        raise ValueError(f"--controls {asked}: {model_type} takes at most {info.max_controls} control image(s) an "
                         "item")
    return asked


class SyntheticCachedLatents(Dataset):
    """Items shaped like the trainer's cached items of `model_type`: latents, text embeddings, sizes.

    A small pool of random tensors is reused by index, so item creation costs nothing measurable.
    """

    def __init__(self, model_type: str, resolution: int, length: int, pool: int = 16, variant: str = "",
                 frames: int = 1, controls: int | None = None) -> None:
        """`frames`: video frames per item (`data.video_frames`), for a family whose latents have a frame axis.
        `controls`: control images per item, each of the target's size (their latents join its tokens, so the
        sequence grows by a target's tokens for each); None: one for an edit model that needs them, none
        otherwise (Flux.2's reference images are optional)."""
        gen = torch.Generator().manual_seed(0)
        controls = control_count(model_type, controls)
        if variant == DEMO:
            channels, text_shapes, scale = _demo_shapes(model_type)
        else:
            channels, text_shapes = family(model_type).cached_shapes(**_variant(variant))
            scale = family(model_type).latent_scale(**_variant(variant))
        lat = resolution // scale
        latent_frames = family(model_type).latent_frames(frames)
        self.length = length
        self.resolution = resolution
        shape = (channels, lat, lat) if latent_frames is None else (channels, latent_frames, lat, lat)
        self.latents = torch.randn(pool, *shape, generator=gen)
        self.controls = torch.randn(pool, controls, *shape, generator=gen) if controls else None
        # A token mask (`..._mask`: the families whose captions keep their own length) is all ones: every
        # synthetic caption has the full length.
        self.text = {name: torch.ones(pool, *shape) if name.endswith("_mask") else torch.randn(pool, *shape, generator=gen)
                     for name, shape in text_shapes.items()}
        self.buckets = [0] * length
        self.bucket_sizes = [(resolution, resolution)]

    def validation_set(self):
        """No held-out images: benchmarks time training steps only."""
        return None

    def item_groups(self):
        """No regularisation items."""
        return None

    def clip_paths(self) -> list:
        """No video files to check against the model (the items are latents already)."""
        return []

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key) -> dict:
        index = key[1] if isinstance(key, tuple) else key
        i = index % self.latents.shape[0]
        size = (self.resolution, self.resolution)
        item = {"index": index, "latents": self.latents[i], "text": {k: v[i] for k, v in self.text.items()},
                "caption": "", "original_size": size, "crop_coords": (0, 0), "target_size": size}
        if self.controls is not None:
            item["control_latents"] = self.controls[i]
        return item


def write_random_model(model_type: str, folder, dtype: torch.dtype | None = None, device: str = "cpu",
                       variant: str = ""):
    """A complete diffusers folder of a real-size model with random weights (for GPU checks offline).

    Unlike `random_bundle`, every part is properly initialised, so the VAE and text encoders can run.
    `dtype`: the saved dtype (None: fp16 for the SD families, bf16 for the transformer families)."""
    return family(model_type).write_random_model(folder, dtype, device, **_variant(variant))
