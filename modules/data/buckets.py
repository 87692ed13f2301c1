"""Aspect-ratio buckets and the resize-to-cover + crop that fits an image into its bucket."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

MAX_ASPECT_RATIO = 2.0
"""Longest side / shortest side of the most extreme bucket (kohya's default range)."""
VAE_FACTOR = 8


def make_buckets(resolution: int, step: int = 64, aspect_bucketing: bool = True,
                 max_aspect_ratio: float = MAX_ASPECT_RATIO, min_side: int = 0,
                 max_side: int = 0) -> list[tuple[int, int]]:
    """Bucket sizes `(width, height)` with about `resolution**2` pixels, sides multiples of `step`.

    `min_side` / `max_side` (0: no bound) drop the buckets with a side outside them (kohya's
    min_bucket_reso / max_bucket_reso), which limits how extreme the aspect ratios get; the square
    bucket must lie inside them. Sorted by aspect ratio (portrait first). Without aspect bucketing:
    one square bucket.
    """
    if resolution % VAE_FACTOR:
        raise ValueError(f"data.resolution={resolution} is not a multiple of {VAE_FACTOR} (the VAE's "
                         f"downscale factor); use e.g. {resolution // VAE_FACTOR * VAE_FACTOR}.")
    if not aspect_bucketing:
        return [(resolution, resolution)]
    if step <= 0 or step % VAE_FACTOR or step > resolution:
        raise ValueError(f"data.bucket_step={step} must be a positive multiple of {VAE_FACTOR} and at "
                         f"most data.resolution={resolution}; 64 is the usual value.")
    area = resolution * resolution
    sizes = set()
    for width in range(step, int(resolution * math.sqrt(max_aspect_ratio)) + step, step):
        height = area // width // step * step
        if height < step:
            continue
        if max(width, height) / min(width, height) <= max_aspect_ratio + 1e-9:
            sizes.add((width, height))
    square = resolution // step * step
    sizes.add((square, square))
    if min_side or max_side:
        if not (min_side or 0) <= square <= (max_side or square):
            raise ValueError(f"data.min_bucket_size={min_side} and data.max_bucket_size={max_side} leave out the "
                             f"square bucket of data.resolution={resolution}; keep the resolution between them.")
        upper = max_side or max(max(wh) for wh in sizes)
        sizes = {(w, h) for w, h in sizes if min(w, h) >= min_side and max(w, h) <= upper}
    return sorted(sizes, key=lambda wh: (wh[0] / wh[1], wh[0]))


def closest_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> int:
    """Index of the bucket whose aspect ratio is nearest (in log space) to the image's."""
    target = math.log(width / height)
    # Ties go to the bigger bucket, so that less of the image is thrown away by downscaling.
    return min(range(len(buckets)),
               key=lambda i: (abs(math.log(buckets[i][0] / buckets[i][1]) - target),
                              -buckets[i][0] * buckets[i][1]))


@dataclass(frozen=True)
class CropPlan:
    """How one image becomes one bucket-sized picture. Sizes are (height, width), SDXL's order."""

    original_size: tuple[int, int]
    resized_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    target_size: tuple[int, int]
    flip: bool = False

    @property
    def crop_coords(self) -> tuple[int, int]:
        """(top, left) of the crop as SDXL is told: measured from the mirrored side when flipped."""
        top, left = self.crop_top_left
        if self.flip:
            left = self.resized_size[1] - self.target_size[1] - left
        return top, left

    def key(self) -> str:
        return (f"{self.original_size[0]}x{self.original_size[1]}-{self.resized_size[0]}x{self.resized_size[1]}"
                f"-{self.crop_top_left[0]}.{self.crop_top_left[1]}-{self.target_size[0]}x{self.target_size[1]}"
                f"-{'f' if self.flip else 'n'}")


def plan_crop(width: int, height: int, bucket: tuple[int, int], rng: random.Random | None = None) -> CropPlan:
    """Scale the image to cover the bucket, then crop the centre (or a random spot with `rng`)."""
    bucket_w, bucket_h = bucket
    scale = max(bucket_w / width, bucket_h / height)
    resized_w = max(bucket_w, round(width * scale))
    resized_h = max(bucket_h, round(height * scale))
    extra_w, extra_h = resized_w - bucket_w, resized_h - bucket_h
    if rng is None:
        left, top = extra_w // 2, extra_h // 2
    else:
        left, top = rng.randint(0, extra_w), rng.randint(0, extra_h)
    return CropPlan(original_size=(height, width), resized_size=(resized_h, resized_w),
                    crop_top_left=(top, left), target_size=(bucket_h, bucket_w))


def load_pixels(path, plan: CropPlan) -> torch.Tensor:
    """The image after `plan`, as a float tensor [3, H, W] in [-1, 1]."""
    with Image.open(path) as img:
        img = img.convert("RGB")
        if img.size != (plan.original_size[1], plan.original_size[0]):
            raise ValueError(f"Image {path} is now {img.size[0]}x{img.size[1]} but was "
                             f"{plan.original_size[1]}x{plan.original_size[0]} when scanned; restart to rescan.")
        array = np.asarray(apply_plan(img, plan), dtype=np.uint8).copy()
    pixels = torch.from_numpy(array).permute(2, 0, 1).float()
    return pixels / 127.5 - 1.0


def apply_plan(img: Image.Image, plan: CropPlan) -> Image.Image:
    """`img` resized, cropped and flipped as `plan` says (an image and its mask take the same plan)."""
    resized_h, resized_w = plan.resized_size
    img = img.resize((resized_w, resized_h), Image.Resampling.LANCZOS)
    top, left = plan.crop_top_left
    target_h, target_w = plan.target_size
    img = img.crop((left, top, left + target_w, top + target_h))
    if plan.flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return img
