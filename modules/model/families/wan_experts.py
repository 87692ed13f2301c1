"""Wan 2.2 releases: which one a folder holds, and the two experts of T2V A14B.

- **T2V A14B** has two 14B transformers of the same shape: `transformer` denoises the high-noise steps and
  `transformer_2` the low-noise ones; `WanPipeline` switches at the scheduler timestep
  `boundary_ratio x 1000` (0.875: `transformer` for t >= 875). Each expert is trained on its own range, one
  per run, as musubi-tuner does (`--min_timestep` / `--max_timestep` around `--timestep_boundary`) and as
  ai-toolkit does per expert (`train_high_noise` / `train_low_noise`, the timesteps clipped to the expert's
  stage). `model.wan_expert` names the expert; the other one is loaded frozen for sampling only.
- **TI2V 5B** has one transformer on the Wan 2.2 VAE's 48 channels (16x smaller sides) and
  `expand_timesteps`: `WanPipeline` gives every latent token its own timestep, which for text-to-video is the
  same t everywhere (the image-to-video mode sets the first frame's to 0), so training passes the one t.

The expert's timesteps are the family's usual ones (logit-normal, shifted as the scheduler shifts them)
truncated to its range: the same shape of distribution inside the range, drawn without rejection loops from
the same keyed random numbers, so N ranks x B still draw what 1 rank x N*B does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

EXPERTS = ("high_noise", "low_noise")
"""`model.wan_expert`'s values: `transformer` (t >= boundary) and `transformer_2` (t < boundary)."""
EXPERT_FOLDERS = {"high_noise": "transformer", "low_noise": "transformer_2"}
BOUNDARY_RATIO = 0.875
"""Wan 2.2 T2V A14B's `boundary_ratio` (its diffusers release's model_index.json): what the random models write."""


@dataclass(frozen=True)
class ExpertPlan:
    """Which expert of a two-expert folder trains, and where the pipeline switches."""
    trained: str
    """`high_noise` or `low_noise`."""
    boundary: float
    """The folder's `boundary_ratio`: the flow time t (0 clean, 1 noise) where the experts switch."""

    @property
    def trained_folder(self) -> str:
        return EXPERT_FOLDERS[self.trained]

    @property
    def frozen_folder(self) -> str:
        return EXPERT_FOLDERS[EXPERTS[1 - EXPERTS.index(self.trained)]]

    @property
    def time_range(self) -> tuple[float, float]:
        """[low, high] of the trained expert's flow times: the pipeline gives t = boundary to the high-noise
        expert, so the low-noise expert's range ends at the float32 just below it."""
        if self.trained == "high_noise":
            return self.boundary, 1.0
        below = torch.nextafter(torch.tensor(self.boundary, dtype=torch.float32), torch.tensor(0.0))
        return 0.0, float(below)


def has_two_experts(index: dict) -> bool:
    """Whether a `WanPipeline` folder's model_index.json names a `transformer_2` (Wan 2.2 A14B)."""
    return (index.get("transformer_2") or [None])[0] is not None


def release(folder: Path, index: dict) -> str:
    """What a WanPipeline folder holds: `Wan 2.2 T2V A14B` (two experts), `Wan 2.2 TI2V 5B` (48-channel
    latents, per-token timesteps) or `Wan 2.1 T2V`."""
    if has_two_experts(index):
        return "Wan 2.2 T2V A14B"
    config = Path(folder) / "transformer" / "config.json"
    channels = json.loads(config.read_text()).get("in_channels") if config.is_file() else None
    if index.get("expand_timesteps") or channels == 48:
        return "Wan 2.2 TI2V 5B"
    return "Wan 2.1 T2V"


def expert_plan(folder: Path, index: dict, wan_expert: str) -> ExpertPlan | None:
    """The expert `model.wan_expert` names for a WanPipeline folder; None for a folder of one transformer.
    Refuses a two-expert folder without the field and a one-transformer folder with it."""
    if not has_two_experts(index):
        if wan_expert:
            raise ValueError(f"model.wan_expert is {wan_expert!r}, but {folder} is {release(folder, index)}, which has "
                             "one transformer; leave model.wan_expert empty (it picks an expert of Wan 2.2 A14B)")
        return None
    if wan_expert not in EXPERTS:
        raise ValueError(f"{folder} is Wan 2.2 T2V A14B, whose two experts (transformer for high noise, transformer_2 "
                         "for low noise) are trained one per run; set model.wan_expert to high_noise or low_noise")
    boundary = index.get("boundary_ratio")
    if not isinstance(boundary, (int, float)) or not 0 < boundary < 1:
        raise ValueError(f"{folder}/model_index.json has two experts but boundary_ratio {boundary!r}; WanPipeline "
                         "switches experts at boundary_ratio x 1000 and needs a value between 0 and 1 (0.875)")
    return ExpertPlan(wan_expert, float(boundary))


def truncated_times(raw: torch.Tensor, shift: float, low: float, high: float, logit_mean: float = 0.0,
                    logit_std: float = 1.0) -> torch.Tensor:
    """Flow times in [low, high] distributed as the shifted logit-normal times are inside that range.

    `raw` are the unshifted draws sigmoid(mean + std z); each z is moved to the same quantile of the normal
    distribution cut to the z that land in [low, high] after the shift (which keeps the order: t -> shift t /
    (1 + (shift - 1) t) rises), then shifted: a monotone map of the same numbers, not a redraw.
    """
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))

    def z_of_shifted(t: float) -> torch.Tensor:  # the z whose shifted time is t (+-inf at the ends)
        if t <= 0.0:
            return torch.tensor(-float("inf"), dtype=torch.float64)
        if t >= 1.0:
            return torch.tensor(float("inf"), dtype=torch.float64)
        unshifted = t / (shift - (shift - 1.0) * t)
        return (torch.logit(torch.tensor(unshifted, dtype=torch.float64)) - logit_mean) / logit_std

    z = (torch.logit(raw.double()) - logit_mean) / logit_std
    lo_cdf, hi_cdf = normal.cdf(z_of_shifted(low)), normal.cdf(z_of_shifted(high))
    quantile = lo_cdf + normal.cdf(z) * (hi_cdf - lo_cdf)
    eps = torch.finfo(torch.float64).eps
    inside = normal.icdf(quantile.clamp(eps, 1 - eps))
    t = torch.sigmoid(logit_mean + logit_std * inside)
    shifted = shift * t / (1 + (shift - 1) * t)
    return shifted.clamp(low, high).to(raw.dtype)
