"""The kohya/LyCORIS layout of the LoRA variants (DoRA, LoHa, LoKr): what ComfyUI and Forge read.

Module names are the family's (`family.lycoris_module_name`), each one ComfyUI maps for that family: kohya's
`lora_unet_*` names for the SD UNets (SDXL in the original layout, as for plain LoRA),
`lora_transformer_<diffusers module path>` (OneTrainer's) for SD3, Flux.1, Flux.2 and Chroma (ComfyUI maps these
names onto the parts of its fused q/k/v weights itself), `lycoris_<diffusers module path>` (SimpleTuner's) for
Qwen-Image and Z-Image, Wan's plain-LoRA names (`diffusion_model.<original name>`), and `lora_te_*` /
`lora_te1_*` / `lora_te2_*` for CLIP text encoders. Tensor names
after the module name are LyCORIS's, which ComfyUI's `comfy/weight_adapter` reads:

- DoRA: `lora_down.weight`, `lora_up.weight`, `alpha` and `dora_scale` [out, 1, ...]. ComfyUI applies an
  output-axis `dora_scale` as `(W + delta) * dora_scale / ||W||` (row norms of the base weight), where
  peft's DoRA computes `(W + delta) * m / ||W + delta||`; so the file holds `m * ||W|| / ||W + delta||`,
  which gives peft's weight in ComfyUI (older ComfyUI builds read only LyCORIS's input-axis DoRA).
- LoHa: `hada_w1_a`, `hada_w1_b`, `hada_w2_a`, `hada_w2_b`, `alpha` (scale alpha / rank, as peft's).
- LoKr: `lokr_w1`, `lokr_w2` or `lokr_w2_a` + `lokr_w2_b`, `alpha`. ComfyUI scales by alpha / rank only
  when a factor is split in two; a module whose factors are both whole has the scale multiplied into
  `lokr_w2` and `alpha` = rank (what LyCORIS writes for such modules), and reading undoes it.
"""
from __future__ import annotations

import torch

from .bundle import checkpoint_text_encoder_key
from .lora_variants import adapted_layers, alpha_and_rank, delta_weight, split_adapter_key, type_of_config

KOHYA_NAMES = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight",
               "lora_magnitude_vector": "dora_scale"}
"""peft tensor name -> LyCORIS name, where they differ (LoHa's and LoKr's are the same in both)."""
PEFT_NAMES = {kohya: peft for peft, kohya in KOHYA_NAMES.items()}
LYCORIS_SUFFIXES = ("lora_down.weight", "lora_up.weight", "dora_scale", "alpha", "hada_w1_a", "hada_w1_b",
                    "hada_w2_a", "hada_w2_b", "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a",
                    "lokr_w2_b")


def layers_by_spelling(bundle, component: str) -> dict:
    """Module path as saved files spell it (text encoders under CLIP's `text_model.`) -> adapted layer."""
    layers = adapted_layers(bundle.modules()[component])
    if not component.startswith("text_encoder"):
        return layers
    return {checkpoint_text_encoder_key(path + ".w").removesuffix(".w"): layer for path, layer in layers.items()}


def _row_norms(weight: torch.Tensor) -> torch.Tensor:
    return weight.reshape(weight.shape[0], -1).norm(dim=1)


def comfy_dora_scale(layer) -> torch.Tensor:
    """The `dora_scale` [out, 1, ...] with which ComfyUI's output-axis DoRA gives this layer's peft weight."""
    base = layer.get_base_layer().weight.detach().float()
    with torch.no_grad():
        delta = delta_weight(layer).detach().float().reshape(base.shape)
        magnitude = layer.lora_magnitude_vector["default"].weight.detach().float().reshape(-1)
        scale = magnitude * _row_norms(base) / _row_norms(base + delta)
    return scale.reshape(base.shape[0], *[1] * (base.dim() - 1))


def lycoris_tensors(bundle, modules: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapters of `modules` (peft layout, by component) in the LyCORIS layout described above."""
    tensors = {}
    for component, state in modules.items():
        config = bundle.modules()[component].peft_config["default"]
        lora_type = type_of_config(config)
        alpha, rank = alpha_and_rank(config)
        layers = layers_by_spelling(bundle, component)
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            module_path, tensor = split_adapter_key(key)
            by_module.setdefault(module_path, {})[tensor] = value
        for module_path, parts in by_module.items():
            name = bundle.family.lycoris_module_name(bundle, component, module_path)
            module_alpha = alpha
            for tensor, value in parts.items():
                if tensor == "lora_magnitude_vector":
                    value = comfy_dora_scale(layers[module_path])
                tensors[f"{name}.{KOHYA_NAMES.get(tensor, tensor)}"] = value
            if lora_type == "lokr" and "lokr_w2" in parts and "lokr_w1" in parts:
                tensors[f"{name}.lokr_w2"] = parts["lokr_w2"] * (alpha / rank)
                module_alpha = float(rank)
            tensors[f"{name}.alpha"] = torch.tensor(module_alpha)
    return tensors


def split_lycoris_key(key: str) -> tuple[str, str]:
    """`<module name>.<LyCORIS tensor>` -> (module name, tensor)."""
    for suffix in LYCORIS_SUFFIXES:
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    raise ValueError(f"{key!r} is not a kohya/LyCORIS LoRA key")


def magnitude_from_dora_scale(base_weight: torch.Tensor, dora_scale: torch.Tensor, down: torch.Tensor,
                              up: torch.Tensor, scale: float) -> torch.Tensor:
    """peft's magnitude from a `dora_scale` written as above, for the module's base weight and the file's
    LoRA pair: m = dora_scale x ||W + delta|| / ||W||."""
    base = base_weight.detach().float()
    delta = (up.float().flatten(1) @ down.float().flatten(1)).reshape(base.shape) * scale
    if dora_scale.numel() != base.shape[0]:
        raise ValueError(f"dora_scale of shape {tuple(dora_scale.shape)} is not one value per output channel "
                         f"({base.shape[0]}): LyCORIS's input-axis DoRA is not what peft trains")
    return dora_scale.float().reshape(-1) * _row_norms(base + delta) / _row_norms(base)
