"""Which Stable Diffusion family an original-layout (LDM / "single file") checkpoint belongs to, and
which target it was trained to predict.

Detection looks only at key names, never at tensor sizes, so it works the same for real checkpoints
and for the tiny models the tests build: the text encoder's layout is what tells the families apart.

| family | text encoder keys |
| --- | --- |
| `sdxl` | `conditioner.embedders.0.transformer.*` (CLIP ViT-L) + `conditioner.embedders.1.model.*` (OpenCLIP bigG) |
| `sd2`  | `cond_stage_model.model.*` (OpenCLIP ViT-H) |
| `sd1`  | `cond_stage_model.transformer.*` (CLIP ViT-L) |
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MODEL_TYPES = ("sd1", "sd2", "sdxl")
PREDICTION_TYPES = ("epsilon", "v_prediction")

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
SD1_TEXT_PREFIX = "cond_stage_model.transformer."
SD2_TEXT_PREFIX = "cond_stage_model.model."
SDXL_TEXT_PREFIX = "conditioner.embedders.0.transformer."
SDXL_TEXT_2_PREFIX = "conditioner.embedders.1.model."
# ComfyUI's marker for v-prediction checkpoints (an empty tensor named "v_pred").
V_PRED_MARKER_KEY = "v_pred"
# The tensor ComfyUI inspects to tell SD 2.x v-models from epsilon ones.
SD2_V_PROBE_KEY = UNET_PREFIX + "output_blocks.11.1.transformer_blocks.0.norm1.bias"


def _key_sample(keys: list[str], count: int = 5) -> str:
    return ", ".join(keys[:count]) + (f", ... ({len(keys)} keys)" if len(keys) > count else "")


def detect_model_type(keys: Iterable[str], source: str | Path = "checkpoint") -> str:
    """`sd1`, `sd2` or `sdxl` from the key names of an original-layout checkpoint; `source` (the file)
    only names the culprit in errors. Raises ValueError for layouts Tandem cannot train."""
    keys = list(keys)
    has = lambda prefix: any(k.startswith(prefix) for k in keys)  # noqa: E731 - local shorthand
    if has(SDXL_TEXT_2_PREFIX):
        return "sdxl"
    if has(SD2_TEXT_PREFIX):
        return "sd2"
    if has(SD1_TEXT_PREFIX):
        return "sd1"
    if has("conditioner.embedders.0.model."):
        reason = "it is an SDXL refiner (one OpenCLIP encoder only), which Tandem does not train"
    elif has(UNET_PREFIX + "joint_blocks.") or has("joint_blocks."):
        reason = "it is a Stable Diffusion 3 checkpoint (model type sd3), not SD 1.x/2.x/SDXL"
    elif has("double_blocks.") or has(UNET_PREFIX + "double_blocks."):
        reason = "it is a Flux checkpoint (model type flux), not SD 1.x/2.x/SDXL"
    elif has("down_blocks.") or has("unet.down_blocks.") or has("text_model."):
        reason = "its keys are in diffusers layout; point model.base_model at the diffusers folder instead"
    elif has(UNET_PREFIX):
        reason = ("it has a UNet but no text encoder, so SD 1.x and 2.x cannot be told apart; "
                  "use a full checkpoint or the diffusers folder")
    else:
        reason = "no Stable Diffusion UNet/text-encoder keys were found"
    raise ValueError(
        f"{source}: cannot detect the model type - {reason}. Supported: SD 1.x, SD 2.x and SDXL base "
        f"single files in the original (LDM) layout, SD3/SD3.5 in Stability's and Flux.1 in Black Forest "
        f"Labs' layout. First keys: {_key_sample(sorted(keys))}"
    )


def _prediction_from_sidecar_yaml(path: Path) -> str | None:
    """A1111 convention: `model.yaml` next to `model.safetensors`; v-models say `parameterization: "v"`."""
    yaml_path = path.with_suffix(".yaml")
    if not yaml_path.is_file():
        return None
    text = yaml_path.read_text(encoding="utf-8", errors="replace")
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "parameterization":
            return "v_prediction" if value.strip().strip("\"'") == "v" else "epsilon"
    return "epsilon"


def resolve_prediction_type(
    requested: str,
    model_type: str,
    path: Path,
    state: Mapping[str, torch.Tensor] | None = None,
    recorded: str | None = None,
) -> str:
    """The training target of a checkpoint, first match wins:

    1. `requested` when it is not `auto` (the `model.prediction_type` setting);
    2. `recorded`: what Tandem wrote into the file's metadata when it saved it;
    3. a `v_pred` key in the checkpoint (ComfyUI's marker) -> `v_prediction`;
    4. an A1111-style `<file>.yaml` next to the checkpoint (`parameterization: "v"` -> `v_prediction`);
    5. SD 2.x only, ComfyUI's heuristic: the spread of one late UNet norm bias is far larger in the
       v-models (std > 0.09) than in the epsilon models;
    6. the family default: `v_prediction` for SD 2.x (the 768-v models, 2.0-v and 2.1, are the usual
       ones; set `epsilon` for the 512-base models), `epsilon` for SD 1.x and SDXL.
    """
    state = state or {}
    if requested != "auto":
        if requested not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type {requested!r} is not one of auto, {', '.join(PREDICTION_TYPES)}.")
        return requested
    if recorded in PREDICTION_TYPES:
        return recorded
    if V_PRED_MARKER_KEY in state:
        return "v_prediction"
    from_yaml = _prediction_from_sidecar_yaml(path)
    if from_yaml is not None:
        return from_yaml
    probe = state.get(SD2_V_PROBE_KEY)
    if model_type == "sd2" and probe is not None:
        guess = "v_prediction" if torch.std(probe.float(), unbiased=False).item() > 0.09 else "epsilon"
        logger.info("%s: SD 2.x prediction type judged %s from the UNet's weights; set "
                    "model.prediction_type to override.", path, guess)
        return guess
    if model_type == "sd2":
        logger.warning(
            "%s: SD 2.x checkpoint without a recorded prediction type; assuming v_prediction (the 768-v models). "
            "For a 512-base SD 2.x model set model.prediction_type to epsilon.", path,
        )
        return "v_prediction"
    return "epsilon"
