"""The kohya LoRA layout: the names kohya sd-scripts writes, which A1111, Forge and ComfyUI expect.

Keys: `<prefix>_<module path with dots as underscores>.lora_down.weight` / `.lora_up.weight` / `.alpha`.
Prefixes: `lora_unet`, and `lora_te` (SD1/SD2) or `lora_te1` / `lora_te2` (SDXL) for the text encoders,
whose paths are spelled as checkpoints spell them (under CLIP's `text_model.`).

UNet module paths follow the UNet sd-scripts trains: for SD 1.x/2.x one with diffusers' module names
(`lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q`); for SDXL its own copy of the
original (sgm/LDM) UNet, so the original names (`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`).
Those come from the same map that writes single-file checkpoints (`ldm_layout.unet_module_to_ldm`).

Earlier Tandem versions wrote SDXL UNet modules in diffusers' names; `kohya_name_table` knows both,
so `lora_reading` reads old and new files.
"""
from __future__ import annotations

import torch

from .ldm_layout import unet_module_to_ldm

KOHYA_PREFIXES = {
    "sd1": {"unet": "lora_unet", "text_encoder": "lora_te"},
    "sd2": {"unet": "lora_unet", "text_encoder": "lora_te"},
    "sdxl": {"unet": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"},
}
DOWN, UP, ALPHA = ".lora_down.weight", ".lora_up.weight", ".alpha"


def kohya_module_name(model_type: str, component: str, module_path: str, unet_config=None) -> str:
    """The kohya name of one module; `unet_config` (the UNet's diffusers config) is needed for SDXL UNets."""
    if component == "unet" and model_type == "sdxl":
        module_path = unet_module_to_ldm(module_path, unet_config)
    return f"{KOHYA_PREFIXES[model_type][component]}_{module_path.replace('.', '_')}"


def kohya_tensors(bundle, modules: dict[str, dict[str, torch.Tensor]],
                  alphas: dict[str, float]) -> dict[str, torch.Tensor]:
    """peft-layout LoRA weights by component (`<module>.lora_A.weight` / `.lora_B.weight`) -> kohya keys,
    with one `.alpha` per module."""
    tensors = {}
    for component, state in modules.items():
        for key, value in state.items():
            module_path, kind = split_peft_key(key)
            name = kohya_module_name(bundle.model_type, component, module_path, bundle.unet.config)
            tensors[name + (DOWN if kind == "lora_A" else UP)] = value
            tensors[name + ALPHA] = torch.tensor(alphas[component])
    return tensors


def split_peft_key(key: str) -> tuple[str, str]:
    """`<module>.lora_A.weight` -> (`<module>`, `lora_A`)."""
    for kind in ("lora_A", "lora_B"):
        suffix = f".{kind}.weight"
        if key.endswith(suffix):
            return key[: -len(suffix)], kind
    raise ValueError(f"unexpected LoRA weight name {key!r} (only lora_A/lora_B weights are supported)")


def kohya_name_table(model_type: str, module_paths: dict[str, list[str]], unet_config) -> dict[str, tuple[str, str]]:
    """kohya name -> (component, module path) for the given module paths of each component. SDXL UNet
    modules answer to both spellings: the original-layout one written now, and the diffusers one that
    earlier Tandem versions wrote."""
    table = {}
    for component, paths in module_paths.items():
        prefix = KOHYA_PREFIXES[model_type][component]
        for path in paths:
            table[f"{prefix}_{path.replace('.', '_')}"] = (component, path)
            if component == "unet" and model_type == "sdxl":
                table[kohya_module_name(model_type, component, path, unet_config)] = (component, path)
    return table
