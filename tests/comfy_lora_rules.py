"""ComfyUI's rules for which LoRA key patches which weight, restated for the tests of the 2026 families.

Read from comfyanonymous/ComfyUI `comfy/lora.py` (`model_lora_keys_unet`, `load_lora`) and `comfy/utils.py`
(`z_image_to_diffusers`), late 2026; written here from that reading, not copied. ComfyUI holds a model's
weights under `diffusion_model.` + the names of its original release, and builds a map from LoRA key stems
to those weights:

- every model: `lora_unet_<name with _>` and `diffusion_model.<name>` for each weight `<name>.weight`;
- Qwen-Image (`QwenImage`, whose names are diffusers'): also `<name>`, `transformer.<name>` and
  `lycoris_<name with _>`;
- Z-Image (`Lumina2`): diffusers' module names - `diffusion_model.<d>`, `transformer.<d>`, `lycoris_<d with _>`
  and `<d>` - map to the original weights, `attention.to_q/to_k/to_v` to row slices of `attention.qkv`.

A stem's tensors are `<stem>.lora_up.weight` + `.lora_down.weight` (or diffusers' `.lora_B.weight` +
`.lora_A.weight`) and an optional `<stem>.alpha`; the patch is `up @ down * alpha / rank` (alpha / rank = 1
without an alpha), added to the weight or its slice. A key no stem takes is reported as not loaded.
"""
from __future__ import annotations

import torch

PREFIX = "diffusion_model."


def key_map(family: str, comfy_state: dict[str, torch.Tensor], diffusers_to_original: dict[str, tuple]) -> dict:
    """Stem -> target weight name, or (name, (dim, offset, size)) for a slice. `comfy_state`: the model's
    weights as ComfyUI names them (with `diffusion_model.`); `diffusers_to_original`: diffusers weight name ->
    the original name, or (name, (dim, offset, size)) (Z-Image's table)."""
    found = {}
    for key in comfy_state:
        if key.startswith(PREFIX) and key.endswith(".weight"):
            stem = key[len(PREFIX):-len(".weight")]
            found[f"lora_unet_{stem.replace('.', '_')}"] = key
            found[key[:-len(".weight")]] = key
    if family == "qwen":
        for key in comfy_state:
            if key.startswith(PREFIX) and key.endswith(".weight"):
                stem = key[len(PREFIX):-len(".weight")]
                found[stem] = found[f"transformer.{stem}"] = found[f"lycoris_{stem.replace('.', '_')}"] = key
    if family == "zimage":
        for name, target in diffusers_to_original.items():
            if name.endswith(".weight"):
                stem = name[:-len(".weight")]
                target = (PREFIX + target[0], target[1]) if isinstance(target, tuple) else PREFIX + target
                for form in (f"{PREFIX}{stem}", f"transformer.{stem}", f"lycoris_{stem.replace('.', '_')}", stem):
                    found[form] = target
    return found


def apply(lora: dict[str, torch.Tensor], mapping: dict, state: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """(the patched weights, the LoRA keys no stem took) - what ComfyUI's loader would do."""
    patched = {k: v.clone() for k, v in state.items()}
    used = set()
    for stem, target in mapping.items():
        for up_name, down_name in ((".lora_up.weight", ".lora_down.weight"), (".lora_B.weight", ".lora_A.weight")):
            if f"{stem}{up_name}" not in lora:
                continue
            up, down = lora[f"{stem}{up_name}"], lora[f"{stem}{down_name}"]
            alpha = lora.get(f"{stem}.alpha")
            scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
            delta = (up.double() @ down.double() * scale).to(up.dtype)
            if isinstance(target, tuple):
                name, (dim, offset, size) = target
                patched[name].narrow(dim, offset, size).add_(delta)
            else:
                patched[target] += delta
            used.update({f"{stem}{up_name}", f"{stem}{down_name}", f"{stem}.alpha"})
            break
    return patched, sorted(set(lora) - used)
