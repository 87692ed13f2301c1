"""Reading LoRA files back into a model: every layout Tandem writes now or wrote before, every variant.

- kohya: `lora_unet_*` / `lora_te*_*` keys with `.lora_down.weight` / `.lora_up.weight` / `.alpha`.
  SDXL UNet modules in the original names (written now, as sd-scripts does) or in diffusers' names
  (what Tandem wrote before).
- kohya/LyCORIS variants (`lycoris_layout.py`): DoRA's `dora_scale`, LoHa's `hada_*`, LoKr's `lokr_*`
  under the family's module names (`lora_transformer_*` for most transformers, `lycoris_*` for Qwen-Image and
  Z-Image, Wan's `diffusion_model.*`; the `lora_transformer_*` names earlier versions wrote for those too).
- peft: `unet.` / `transformer.` / `text_encoder.` / `text_encoder_2.` + peft's tensor names
  (`<module>.lora_A.weight`, `.lora_magnitude_vector`, `.hada_w1_a`, `.lokr_w1`, ...), or diffusers' older
  spellings `lora.down` / `lora_linear_layer.down` that Tandem wrote before (through
  `convert_state_dict_to_diffusers`).

`read_lora` returns the weights in peft's key layout by component; `apply_lora` copies them into the
adapters of a bundle, after checking that type, rank, alpha and modules match; `start_from_file` does
both for `training.lora_init`, naming the file and the fields in its errors; `adapter_settings` says
which adapters match a file (`lora_convert.py` rewrites a file in the current layouts with it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .bundle import checkpoint_text_encoder_key
from .kohya_lora import ALPHA, DOWN, KOHYA_PREFIXES, UP, kohya_name_table
from .lora_variants import TITLES, alpha_and_rank, is_adapter_parameter, split_adapter_key, type_of_config, type_of_keys
from .lycoris_layout import PEFT_NAMES, magnitude_from_dora_scale, split_lycoris_key

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
    lora_type: str = "lora"
    """`lora`, `dora`, `loha` or `lokr`."""
    prescaled: set[str] = field(default_factory=set)
    """Component-qualified keys (`unet:<module>.lokr_w2`) whose tensor holds the adapter's scale multiplied in
    (LoKr modules with both factors whole, see `lycoris_layout.py`); applying divides it out again."""


def read_lora(path: str | Path, bundle) -> LoraWeights:
    """The LoRA weights of `path` for `bundle`'s model (its module names decide what the keys mean)."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = dict(f.metadata() or {})
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    if not tensors:
        raise ValueError(f"{path}: holds no tensors, so no LoRA")
    lora_type = type_of_keys(tensors)
    prescaled: set[str] = set()
    own_names = bundle.family.kohya_names(bundle)
    if lora_type == "lora" and own_names and all(_kohya_module(key)[0] in own_names for key in tensors):
        # The family's own kohya names (Wan's original module names under `diffusion_model.`).
        state, alpha = _from_kohya(path, tensors, bundle, own_names)
        layout = "kohya"
    elif all(key.startswith(LYCORIS_PREFIXES) for key in tensors) or (
            lora_type != "lora" and own_names and all(_lycoris_module(key) in own_names for key in tensors)):
        if lora_type == "lora" and bundle.model_type in KOHYA_PREFIXES:
            state, alpha = _from_kohya(path, tensors, bundle)
        else:
            state, alpha, prescaled = _from_lycoris(path, tensors, bundle, lora_type)
        layout = "kohya"
    else:
        state, alpha = _from_peft(path, tensors, metadata, bundle)
        layout = "peft"
    rank = {component: _rank(path, component, weights, lora_type, metadata) for component, weights in state.items()}
    # A LoKr whose factors are all whole has its scale multiplied in; its alpha is then only in the metadata.
    recorded = _number(metadata.get("ss_network_alpha")) if prescaled else None
    alphas = {c: alpha.get(c, recorded or float(rank[c] or 0)) for c in state}
    return LoraWeights(state, alphas, rank, layout, metadata, lora_type, prescaled)


LYCORIS_PREFIXES = ("lora_unet_", "lora_te", "lora_transformer_", "lycoris_")
"""How the module names of kohya and LyCORIS files begin (Wan's `diffusion_model.` names are the family's own)."""


def _lycoris_module(key: str) -> str:
    try:
        return split_lycoris_key(key)[0]
    except ValueError:
        return key


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _module_paths(module: nn.Module, text_encoder: bool) -> list[str]:
    """Every Linear/Conv2d a LoRA can adapt, by name (peft's wrappers seen through)."""
    paths = []
    for name, child in module.named_modules():
        if ".lora_" in name or not isinstance(child, (nn.Linear, nn.Conv2d)):
            continue
        name = name.removesuffix(".base_layer")
        paths.append(checkpoint_text_encoder_key(name + ".weight").removesuffix(".weight") if text_encoder else name)
    return paths


def _kohya_module(key: str) -> tuple[str, str]:
    """(module name, suffix) of a kohya key: `.lora_down.weight`, `.lora_up.weight` or `.alpha`; suffix '' else."""
    return next(((key[: -len(s)], s) for s in (DOWN, UP, ALPHA) if key.endswith(s)), (key, ""))


def _from_kohya(path: Path, tensors: dict, bundle, table: dict[str, tuple[str, str]] | None = None) -> tuple[dict, dict]:
    """`table`: kohya module name -> (component, module path); the SD families' kohya names by default."""
    if table is None:
        modules = {name: m for name, m in bundle.modules().items() if name != "vae"}
        table = kohya_name_table(bundle.model_type,
                                 {name: _module_paths(m, name.startswith("text_encoder")) for name, m in modules.items()},
                                 bundle.unet.config)
    state: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, set[float]] = {}
    for key, value in tensors.items():
        name, suffix = _kohya_module(key)
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


def _name_table(bundle) -> dict[str, tuple[str, str]]:
    """kohya/LyCORIS module name -> (component, module path), for every module a LoRA can adapt."""
    modules = {name: m for name, m in bundle.modules().items() if name != "vae"}
    paths = {name: _module_paths(m, name.startswith("text_encoder")) for name, m in modules.items()}
    table = {}
    for component, component_paths in paths.items():
        for path in component_paths:
            if component == bundle.denoiser_name and component != "unet":
                # What Tandem wrote for every transformer before Qwen-Image, Z-Image and Wan took the names
                # ComfyUI reads for them.
                table[f"lora_transformer_{path.replace('.', '_')}"] = (component, path)
            try:
                table[bundle.family.lycoris_module_name(bundle, component, path)] = (component, path)
            except ValueError:
                continue  # a module the family's names do not cover (Wan: outside the blocks' linear layers)
    if bundle.model_type in KOHYA_PREFIXES:  # SD UNets: also the spellings earlier Tandem versions wrote
        table.update(kohya_name_table(bundle.model_type, paths, bundle.unet.config))
    return table


def _from_lycoris(path: Path, tensors: dict, bundle, lora_type: str) -> tuple[dict, dict, set[str]]:
    """The kohya/LyCORIS layout of any variant (`lycoris_layout.py`) in peft's names."""
    table = _name_table(bundle)
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        try:
            name, tensor = split_lycoris_key(key)
        except ValueError:
            raise ValueError(f"{path}: {key!r} is not a kohya/LyCORIS LoRA, DoRA, LoHa or LoKr key") from None
        if name not in table:
            raise ValueError(f"{path}: {name!r} names no module of this {bundle.model_type.upper()} model "
                             f"({bundle.source}); is the LoRA for another base model? (A plain LoRA of a "
                             "transformer in the original layout, with fused q/k/v, is read in the peft layout only.)")
        grouped.setdefault(name, {})[tensor] = value
    state: dict[str, dict[str, torch.Tensor]] = {}
    scales: dict[str, set[float]] = {}
    prescaled: set[str] = set()
    for name, parts in grouped.items():
        component, module_path = table[name]
        whole_lokr = "lokr_w1" in parts and "lokr_w2" in parts
        if "alpha" in parts and not whole_lokr:
            rank = _module_rank(parts)
            scales.setdefault(component, set()).add(float(parts["alpha"]) / rank)
        target = state.setdefault(component, {})
        for tensor, value in parts.items():
            if tensor in ("alpha", "dora_scale"):
                continue
            target[f"{module_path}.{PEFT_NAMES.get(tensor, tensor)}"] = value
        if whole_lokr:
            prescaled.add(f"{component}:{module_path}.lokr_w2")
        if "dora_scale" in parts:
            scale = float(parts["alpha"]) / _module_rank(parts) if "alpha" in parts else 1.0
            target[f"{module_path}.lora_magnitude_vector"] = magnitude_from_dora_scale(
                _base_weight(bundle, component, module_path), parts["dora_scale"], parts["lora_down.weight"], parts["lora_up.weight"], scale)
    alphas = {}
    for component, values in scales.items():
        if max(values) - min(values) > 1e-6 * max(values):
            raise ValueError(f"{path}: the {component} modules have different alpha / rank scales {sorted(values)}; "
                             "Tandem's adapters use one alpha per component")
        rank = next(_module_rank(p) for n, p in grouped.items() if table[n][0] == component
                    and "alpha" in p and not ("lokr_w1" in p and "lokr_w2" in p))
        alphas[component] = round(values.pop() * rank, 6)
    return state, alphas, prescaled


def _module_rank(parts: dict[str, torch.Tensor]) -> int:
    """The rank of one module's adapter from its LyCORIS tensors."""
    for tensor, dim in (("lora_down.weight", 0), ("hada_w1_b", 0), ("lokr_w2_b", 0), ("lokr_w1_b", 0)):
        if tensor in parts:
            return int(parts[tensor].shape[dim])
    raise ValueError(f"no rank-bearing tensor among {sorted(parts)}")


def _base_weight(bundle, component: str, module_path: str) -> torch.Tensor:
    """The frozen weight of one module (seen through a peft wrapper), which DoRA's magnitude is measured on."""
    module = bundle.modules()[component]
    own = module_path
    if component.startswith("text_encoder") and not hasattr(module, "text_model"):
        own = module_path.removeprefix("text_model.")  # transformers 5 dropped the wrapper files still name
    layer = module.get_submodule(own)
    return layer.get_base_layer().weight if hasattr(layer, "get_base_layer") else layer.weight


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
        for c in state:
            for name in ("lora_alpha", "alpha"):  # LoRA/DoRA, LoHa/LoKr
                if f"{c}.{name}" in configs:
                    alphas[c] = float(configs[f"{c}.{name}"])
                    break
    return state, alphas


_RANK_TENSORS = (".lora_A.weight", ".hada_w1_b", ".lokr_w2_b", ".lokr_w1_b")
"""Tensors whose first dimension is the rank (LoRA/DoRA's A, LoHa's w1_b, LoKr's split factors)."""


def _rank(path: Path, component: str, weights: dict[str, torch.Tensor], lora_type: str,
          metadata: dict) -> int | None:
    """The adapters' rank; None for a LoKr file whose factors are all whole (its rank leaves no trace but in
    the metadata, and matters only for which factors peft splits)."""
    ranks = {value.shape[0] for key, value in weights.items() if key.endswith(_RANK_TENSORS)}
    if not ranks and lora_type == "lokr":
        dim = metadata.get("ss_network_dim", "")
        return int(dim) if dim.isdigit() else None
    if len(ranks) != 1:
        raise ValueError(f"{path}: the {component} modules have ranks {sorted(ranks)}; expected one rank")
    return ranks.pop()


def apply_lora(bundle, weights: LoraWeights) -> None:
    """Copy `weights` into the bundle's adapters (attached by `add_lora` with the same type, rank and
    alpha, on the same modules); a ValueError says what differs."""
    modules = bundle.modules()
    for component, state in weights.state.items():
        module = modules[component]
        config = getattr(module, "peft_config", {}).get("default")
        if config is None:
            raise ValueError(f"the file has {component} weights and the {component} has no adapter "
                             "(training.train_text_encoder is off, or add_lora was not called)")
        own_type = type_of_config(config)
        if own_type != weights.lora_type:
            raise ValueError(f"the file holds {TITLES[weights.lora_type]} weights and the adapters are "
                             f"{TITLES[own_type]} (training.lora_type {own_type}); set training.lora_type to "
                             f"{weights.lora_type}")
        alpha, rank = alpha_and_rank(config)
        file_rank = weights.rank[component]
        if file_rank is not None and file_rank != rank:
            raise ValueError(f"the {component}'s adapter has rank {rank} (training.lora_rank) and the file rank "
                             f"{file_rank}; set training.lora_rank to {file_rank}")
        if weights.alpha[component] and abs(weights.alpha[component] - alpha) > 1e-6 * max(1.0, alpha):
            raise ValueError(f"the {component}'s adapter has alpha {alpha:g} (training.lora_alpha) and the file "
                             f"alpha {weights.alpha[component]:g}; set training.lora_alpha to {weights.alpha[component]:g}")
        targets = _adapter_tensors(component, module)
        wanted, given = set(targets), set(state)
        if wanted != given:
            missing = sorted({split_adapter_key(k)[0] for k in wanted - given})
            extra = sorted({split_adapter_key(k)[0] for k in given - wanted})
            parts = []
            if extra:
                parts.append(f"the file adapts {len(extra)} {component} module(s) the adapters do not, e.g. {extra[:3]}")
            if missing:
                parts.append(f"{len(missing)} adapted {component} module(s) have no weights in the file, e.g. {missing[:3]}")
            if not parts:
                parts.append(f"its tensors differ: {sorted(given ^ wanted)[:3]}")
            raise ValueError("; ".join(parts) + " (training.lora_target_modules names the adapted modules)")
        for key, value in state.items():
            target = targets[key]
            if key.endswith(".lora_magnitude_vector"):
                value = value.reshape(target.shape)
            if f"{component}:{key}" in weights.prescaled:
                value = value / (alpha / rank)
            if target.shape != value.shape:
                raise ValueError(f"{component} {key}: shape {tuple(value.shape)} in the file, "
                                 f"{tuple(target.shape)} in the adapter")
            with torch.no_grad():
                target.copy_(value)


def _adapter_tensors(component: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """peft-spelled adapter key (as files hold them) -> the parameter that holds it."""
    found = {}
    for name, param in module.named_parameters():
        if not is_adapter_parameter(name) or ".default" not in name:
            continue
        key = name.replace(".default", "")
        if key.endswith(".lora_magnitude_vector.weight"):
            key = key.removesuffix(".weight")
        if component.startswith("text_encoder"):
            key = checkpoint_text_encoder_key(key)
        found[key] = param
    return found


def start_from_file(bundle, path: str) -> None:
    """`training.lora_init`: the adapters just attached take the weights of the LoRA file `path`."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"training.lora_init: {str(file)!r} does not exist; set it to a LoRA .safetensors "
                                "file or leave it empty")
    try:
        weights = read_lora(file, bundle)
        apply_lora(bundle, weights)
    except ValueError as error:
        message = str(error).removeprefix(f"{file}: ")
        raise ValueError(f"training.lora_init {str(file)!r}: {message}") from None


def adapter_settings(weights: LoraWeights) -> dict:
    """`TrainingConfig` fields that attach adapters matching the file (targets named by full path)."""
    denoiser = "unet" if "unet" in weights.state else "transformer"
    modules = sorted({split_adapter_key(key)[0] for key in weights.state.get(denoiser, {})})
    return {"lora_rank": weights.rank[denoiser], "lora_alpha": weights.alpha[denoiser],
            "lora_target_modules": modules, "lora_type": weights.lora_type,
            "train_text_encoder": any(c.startswith("text_encoder") for c in weights.state)}
