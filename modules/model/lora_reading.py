"""Reading LoRA files back into a model: every layout Tandem writes now or wrote before.

- kohya: `lora_unet_*` / `lora_te*_*` keys with `.lora_down.weight` / `.lora_up.weight` / `.alpha`.
  SDXL UNet modules in the original names (written now, as sd-scripts does) or in diffusers' names
  (what Tandem wrote before).
- peft: `unet.` / `text_encoder.` / `text_encoder_2.` + `<module>.lora_A.weight` / `.lora_B.weight`
  (written now), or diffusers' older spellings `lora.down` / `lora_linear_layer.down` that Tandem
  wrote before (through `convert_state_dict_to_diffusers`).

`read_lora` returns the weights in peft's key layout by component; `apply_lora` copies them into the
adapters of a bundle; `convert_lora_file` rewrites a file in the current layouts (an SDXL LoRA from an
older Tandem then loads in A1111/Forge as sd-scripts' files do).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .bundle import checkpoint_text_encoder_key
from .kohya_lora import ALPHA, DOWN, UP, kohya_name_table
from .lora_metadata import file_metadata

_OLD_PEFT_SPELLINGS = {".lora_linear_layer.down.": ".lora_A.", ".lora_linear_layer.up.": ".lora_B.",
                       ".lora.down.": ".lora_A.", ".lora.up.": ".lora_B."}


@dataclass
class LoraWeights:
    state: dict[str, dict[str, torch.Tensor]]
    """Component (`unet`, `text_encoder`, `text_encoder_2`) -> `<module>.lora_A.weight` / `.lora_B.weight`;
    text-encoder modules as checkpoints spell them (under `text_model.`)."""
    alpha: dict[str, float]
    rank: dict[str, int]
    layout: str
    """`kohya` or `peft`."""
    metadata: dict[str, str]


def read_lora(path: str | Path, bundle) -> LoraWeights:
    """The LoRA weights of `path` for `bundle`'s model (its module names decide what the keys mean)."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = dict(f.metadata() or {})
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    if not tensors:
        raise ValueError(f"{path}: holds no tensors, so no LoRA")
    if all(key.startswith(("lora_unet_", "lora_te")) for key in tensors):
        state, alpha = _from_kohya(path, tensors, bundle)
        layout = "kohya"
    else:
        state, alpha = _from_peft(path, tensors, metadata, bundle)
        layout = "peft"
    rank = {component: _rank(path, component, weights) for component, weights in state.items()}
    return LoraWeights(state, {c: alpha.get(c, float(rank[c])) for c in state}, rank, layout, metadata)


def _module_paths(module: nn.Module, text_encoder: bool) -> list[str]:
    """Every Linear/Conv2d a LoRA can adapt, by name (peft's wrappers seen through)."""
    paths = []
    for name, child in module.named_modules():
        if ".lora_" in name or not isinstance(child, (nn.Linear, nn.Conv2d)):
            continue
        name = name.removesuffix(".base_layer")
        paths.append(checkpoint_text_encoder_key(name + ".weight").removesuffix(".weight") if text_encoder else name)
    return paths


def _from_kohya(path: Path, tensors: dict, bundle) -> tuple[dict, dict]:
    modules = {name: m for name, m in bundle.modules().items() if name != "vae"}
    table = kohya_name_table(bundle.model_type,
                             {name: _module_paths(m, name.startswith("text_encoder")) for name, m in modules.items()},
                             bundle.unet.config)
    state: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, set[float]] = {}
    for key, value in tensors.items():
        name, suffix = next(((key[: -len(s)], s) for s in (DOWN, UP, ALPHA) if key.endswith(s)), (key, ""))
        if not suffix:
            raise ValueError(f"{path}: {key!r} is not a kohya LoRA key (.lora_down.weight, .lora_up.weight, .alpha)")
        if name not in table:
            raise ValueError(f"{path}: {name!r} names no module of this {bundle.model_type.upper()} model "
                             f"({bundle.source}); is the LoRA for another base model?")
        component, module_path = table[name]
        if suffix == ALPHA:
            alphas.setdefault(component, set()).add(float(value))
        else:
            state.setdefault(component, {})[f"{module_path}.{'lora_A' if suffix == DOWN else 'lora_B'}.weight"] = value
    for component, values in alphas.items():
        if len(values) > 1:
            raise ValueError(f"{path}: the {component} modules have different alphas {sorted(values)}; "
                             "Tandem's adapters use one alpha per component")
    return state, {component: values.pop() for component, values in alphas.items()}


def _from_peft(path: Path, tensors: dict, metadata: dict, bundle) -> tuple[dict, dict]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    components = tuple(name for name in bundle.modules() if name != "vae")
    for key, value in tensors.items():
        component, _, rest = key.partition(".")
        if component not in components:
            raise ValueError(f"{path}: {key!r} is neither a kohya key of an {bundle.model_type.upper()} LoRA "
                             f"nor a diffusers one (which start with {', '.join(c + '.' for c in components)})")
        for old, new in _OLD_PEFT_SPELLINGS.items():
            rest = rest.replace(old, new)
        state.setdefault(component, {})[rest] = value
    alphas = {}
    if "lora_adapter_metadata" in metadata:
        configs = json.loads(metadata["lora_adapter_metadata"])
        alphas = {c: float(configs[f"{c}.lora_alpha"]) for c in state if f"{c}.lora_alpha" in configs}
    return state, alphas


def _rank(path: Path, component: str, weights: dict[str, torch.Tensor]) -> int:
    ranks = {value.shape[0] for key, value in weights.items() if key.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise ValueError(f"{path}: the {component} modules have ranks {sorted(ranks)}; expected one rank")
    return ranks.pop()


def apply_lora(bundle, weights: LoraWeights) -> None:
    """Copy `weights` into the bundle's adapters (attached by `add_lora` with the same rank and alpha)."""
    modules = bundle.modules()
    for component, state in weights.state.items():
        module = modules[component]
        config = getattr(module, "peft_config", {}).get("default")
        if config is None:
            raise ValueError(f"the {component} has no LoRA adapter to load into; call add_lora first")
        if (int(config.r), float(config.lora_alpha)) != (weights.rank[component], weights.alpha[component]):
            raise ValueError(f"the {component}'s adapter has rank {config.r}, alpha {config.lora_alpha}; the file "
                             f"has rank {weights.rank[component]}, alpha {weights.alpha[component]}")
        by_name = {}
        for name, child in module.named_modules():
            if hasattr(child, "lora_A") and "default" in getattr(child, "lora_A", {}):
                spelled = checkpoint_text_encoder_key(name + ".w").removesuffix(".w") if component != "unet" else name
                by_name[spelled] = child
        loaded = set()
        for key, value in state.items():
            module_path, _, kind = key.removesuffix(".weight").rpartition(".")
            if module_path not in by_name:
                raise ValueError(f"the file has LoRA weights for {component} module {module_path!r}, which has no adapter")
            target = getattr(by_name[module_path], kind)["default"].weight
            if target.shape != value.shape:
                raise ValueError(f"{component} {key}: shape {tuple(value.shape)} in the file, "
                                 f"{tuple(target.shape)} in the adapter")
            with torch.no_grad():
                target.copy_(value)
            loaded.add(module_path)
        missing = sorted(set(by_name) - loaded)
        if missing:
            raise ValueError(f"the file has no weights for {len(missing)} adapted {component} modules, e.g. {missing[:3]}")


def adapter_settings(weights: LoraWeights) -> dict:
    """`TrainingConfig` fields that attach adapters matching the file (targets named by full path)."""
    unet_modules = sorted({key.rsplit(".", 2)[0] for key in weights.state.get("unet", {})})
    return {"lora_rank": weights.rank["unet"], "lora_alpha": weights.alpha["unet"],
            "lora_target_modules": unet_modules,
            "train_text_encoder": any(c.startswith("text_encoder") for c in weights.state)}


def convert_lora_file(source: str | Path, target: str | Path, base_model: str, fmt: str,
                      dtype: str = "fp16") -> Path:
    """Rewrite the LoRA `source` (any layout above) for `base_model` as `target` in today's `fmt` layout;
    the metadata of the source is kept where the new file does not set it."""
    from modules.config.train_config import ModelConfig, TrainingConfig

    from .loading import load_model
    from .lora import add_lora, save_lora

    bundle = load_model(ModelConfig(base_model=base_model))
    weights = read_lora(source, bundle)
    add_lora(bundle, TrainingConfig(precision="fp32", **adapter_settings(weights)))
    apply_lora(bundle, weights)
    # What describes the new file (layout, implementation, base model by name) is written anew; an old
    # file's `tandem_base_model` may even hold a full local path.
    fresh = set(file_metadata(bundle, fmt, weights.rank["unet"], weights.alpha["unet"], "")) | {
        "format", "lora_adapter_metadata"}
    kept = {k: v for k, v in weights.metadata.items() if k not in fresh}
    return save_lora(bundle, target, fmt, dtype, kept)
