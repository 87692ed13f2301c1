"""An edit model's control images in the step: what the dataset serves them as, and whether its text carries them.

The dataset serves each item's controls as cached latents (`control_latents`, [B, K, C, h, w]) or as pixels
(`control_pixels`, [B, K, 3, H, W]) to encode now; the family's objective takes them as `controls`
(`families/qwen_image_edit.py`). A family whose text encoder reads the controls (`FamilyInfo.controls`
`latents+text`) has the dataset put them in each caption's text (`data/controls.text_with_controls`).
"""
from __future__ import annotations

import torch

from modules.families.registry import FAMILIES, guess_family


def text_sees_controls(model_cfg) -> bool:
    """Whether the model's text encoder reads each caption with its pair's control images."""
    family = guess_family(model_cfg.base_model, model_cfg.model_type)
    return family in FAMILIES and FAMILIES[family].controls == "latents+text"


def control_latents(bundle, batch: dict, device: torch.device) -> torch.Tensor | None:
    """The batch's control latents [B, K, C, h, w] on `device` in float32 (encoded now when not cached), or None for
    a batch without controls. Encoded as the edit pipelines encode a control: the mode of the VAE's distribution."""
    if "control_latents" in batch:
        return batch["control_latents"].to(device, non_blocking=True).float()
    pixels = batch.get("control_pixels")
    if pixels is None:
        return None
    count, controls = pixels.shape[:2]
    with torch.no_grad():
        mean, _ = bundle.encode_latent_distribution(pixels.flatten(0, 1).to(device, non_blocking=True))
    return mean.float().unflatten(0, (count, controls))
