"""The LoRA variants (`training.lora_type`): plain LoRA, DoRA, LoHa and LoKr, all through peft.

Everything here is independent of the model family: a variant is a peft config on the family's target
modules, its trainable tensors are the peft parameters of that config, and its file layouts are
written by `lora.py` (peft layout) and `lycoris_layout.py` (the kohya/LyCORIS names ComfyUI reads), so a
new family gets every variant with its LoRA targets alone.

- `lora`: `LoraConfig` (A/B matrices, scale alpha / rank).
- `dora`: `LoraConfig(use_dora=True)`: LoRA's direction plus a trained magnitude per output channel
  (peft's `lora_magnitude_vector`, initialised to the base weight's row norms).
- `loha`: `LoHaConfig`: delta = (w1_a @ w1_b) * (w2_a @ w2_b) x alpha / rank (element-wise product).
- `lokr`: `LoKrConfig`: delta = kron(w1, w2) x alpha / rank, w2 factored as w2_a @ w2_b when rank is
  small enough for that to be smaller (peft's rule); `training.lokr_factor` picks how the sides split.
Every variant starts with a zero delta, so the model is unchanged until the first optimizer step.
"""
from __future__ import annotations

from torch import nn

from modules.config.train_config import LORA_TYPES  # noqa: F401 - declared with the config field

ADAPTER_MARKERS = (".lora_", ".hada_", ".lokr_")
"""What peft's parameter names of the variants contain (`to_q.lora_A.default.weight`,
`to_q.hada_w1_a.default`, `to_q.lokr_w1.default`, `to_q.lora_magnitude_vector.default.weight`)."""

ADAPTER_TENSORS = {
    "lora": ("lora_A.weight", "lora_B.weight"),
    "dora": ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector"),
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
    "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b"),
}
"""The tensor names of each variant's adapter on one module, as peft's state dicts spell them after the
module path (`<module>.lora_A.weight`); a LoKr module has w1 or w1_a/w1_b, and w2 or w2_a/w2_b."""

TITLES = {"lora": "LoRA", "dora": "DoRA", "loha": "LoHa", "lokr": "LoKr"}


def peft_config(lora_type: str, rank: int, alpha: float, dropout: float, targets: list[str], lokr_factor: int = -1):
    """The peft config that attaches `lora_type` adapters to the modules named by `targets`."""
    if lora_type in ("lora", "dora"):
        from peft import LoraConfig
        return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                          init_lora_weights="gaussian", use_dora=lora_type == "dora")
    if dropout:
        raise ValueError(f"training.lora_dropout: {dropout} is LoRA's input dropout, which peft's {TITLES[lora_type]} "
                         "does not have; set it to 0.")
    if lora_type == "loha":
        from peft import LoHaConfig
        return LoHaConfig(r=rank, alpha=alpha, target_modules=list(targets), init_weights=True)
    if lora_type == "lokr":
        from peft import LoKrConfig
        return LoKrConfig(r=rank, alpha=alpha, target_modules=list(targets), init_weights=True,
                          decompose_factor=lokr_factor)
    raise ValueError(f"training.lora_type: {lora_type!r} is not one of {', '.join(LORA_TYPES)}")


def type_of_config(config) -> str:
    """The `training.lora_type` a peft adapter config stands for."""
    name = type(config).__name__
    if name == "LoHaConfig":
        return "loha"
    if name == "LoKrConfig":
        return "lokr"
    return "dora" if getattr(config, "use_dora", False) else "lora"


def alpha_and_rank(config) -> tuple[float, int]:
    """(alpha, rank) of any variant's config (LoRA calls alpha `lora_alpha`, LyCORIS's `alpha`)."""
    alpha = config.lora_alpha if hasattr(config, "lora_alpha") else config.alpha
    return float(alpha), int(config.r)


def is_adapter_parameter(name: str) -> bool:
    return any(marker in name for marker in ADAPTER_MARKERS)


def type_of_keys(keys) -> str:
    """The variant a set of adapter tensor names (peft's or kohya's spelling) holds."""
    keys = list(keys)
    if any(".hada_" in k for k in keys):
        return "loha"
    if any(".lokr_" in k for k in keys):
        return "lokr"
    if any(k.endswith((".lora_magnitude_vector", ".dora_scale")) for k in keys):
        return "dora"
    return "lora"


def split_adapter_key(key: str) -> tuple[str, str]:
    """`<module>.<tensor>` -> (`<module>`, `<tensor>`) for any variant's peft-spelled tensor name."""
    for names in ADAPTER_TENSORS.values():
        for tensor in names:
            if key.endswith("." + tensor):
                return key[: -len(tensor) - 1], tensor
    raise ValueError(f"unexpected adapter tensor name {key!r} (not a LoRA, DoRA, LoHa or LoKr weight)")


def adapted_layers(module: nn.Module) -> dict[str, nn.Module]:
    """Module path -> peft layer, for every layer of `module` that carries the `default` adapter."""
    layers = {}
    for name, child in module.named_modules():
        for attribute in ("lora_A", "hada_w1_a", "lokr_w1", "lokr_w1_a"):
            holder = getattr(child, attribute, None)
            if holder is not None and "default" in holder:
                layers[name] = child
                break
    return layers


def delta_weight(layer: nn.Module):
    """The weight change an adapted layer applies (without DoRA's magnitude), as peft computes it."""
    return layer.get_delta_weight("default")
