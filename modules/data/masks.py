"""Loss masks: `<image>-masklabel.png` beside an image says which of its pixels to learn (white) or leave out (black).

A mask goes through the image's own resize/crop/flip plan (`buckets.CropPlan`), so it stays aligned with the
crop the model sees, and is then averaged over each VAE_FACTOR x VAE_FACTOR block of pixels: one weight per
latent pixel, in [0, 1] (a block the mask's edge crosses gets the fraction of it that is white). The training
loss then weighs each latent value by `unmasked_weight + (1 - unmasked_weight) x mask` (`loss_weights`).

A mask's value depends on the mask file and the plan alone, never on who computes it, so a cached mask is
the same whichever rank or how many of them built the cache (like the latents' distributions, cache.py).
"""
from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

from .buckets import VAE_FACTOR, CropPlan, apply_plan

MASK_SUFFIX = "-masklabel.png"
"""`photo.jpg` has the mask `photo-masklabel.png` in the same folder."""


class MaskError(ValueError):
    """A mask file that cannot be used with its image."""


def is_mask_file(path: Path) -> bool:
    """Mask files are never training images themselves."""
    return path.name.lower().endswith(MASK_SUFFIX)


def mask_file_for(image: Path) -> Path:
    return image.with_name(image.stem + MASK_SUFFIX)


def find_mask(image: Path, width: int, height: int) -> tuple[Path, str] | None:
    """(path, sha256) of the image's mask, None when it has none; a mask that is unreadable or of another
    size than its image is an error naming both files."""
    path = mask_file_for(image)
    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as mask:
            mask.load()
            size = mask.size
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as err:
        raise MaskError(f"Mask {path} (of image {image.name}) cannot be read ({err}); save it again as a PNG, "
                        "or delete it to train on the whole image.") from None
    if size != (width, height):
        raise MaskError(f"Mask {path} is {size[0]}x{size[1]} but its image {image.name} is {width}x{height}; "
                        "a mask must have its image's size (white = learn, black = leave out).")
    return path, hashlib.sha256(data).hexdigest()


def load_mask(path: Path, plan: CropPlan) -> torch.Tensor:
    """The mask after the image's `plan` (resize, crop, flip), at latent resolution: float32 [1, H/8, W/8] in [0, 1]."""
    with Image.open(path) as img:
        # The image's own plan and resampling filter, so that the mask's edges fall where the image's do;
        # the filter's overshoot at hard edges is clipped back into [0, 1] below.
        array = np.asarray(apply_plan(img.convert("L"), plan), dtype=np.uint8).copy()
    pixels = torch.from_numpy(array).float().div_(255.0)[None, None]
    return F.avg_pool2d(pixels, VAE_FACTOR)[0].clamp_(0.0, 1.0)


def loss_weights(mask: torch.Tensor, unmasked_weight: float) -> torch.Tensor:
    """Per-latent loss weights: 1 where the mask is white, `unmasked_weight` where it is black."""
    return unmasked_weight + (1.0 - unmasked_weight) * mask


def flip_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask of the mirrored crop: block averages over whole 8-pixel columns mirror exactly."""
    return torch.flip(mask, dims=[-1])
