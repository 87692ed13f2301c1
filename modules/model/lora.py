"""LoRA adapters (peft) on the denoiser and optionally the text encoders, and saving them.

Two file layouts:
- `kohya`: what kohya sd-scripts writes and ComfyUI, A1111 and Forge read: keys
  `lora_unet_<module path with _>.lora_down.weight` / `.lora_up.weight` / `.alpha`. The module paths are
  the family's business (`family.kohya_lora_tensors`): SD1.x/2.x in diffusers' names and SDXL in the
  original (LDM) UNet names, as sd-scripts writes each (`kohya_lora.py`), with `lora_te_` (SD1/SD2) or
  `lora_te1_` / `lora_te2_` (SDXL) for text encoders; SD3 and Flux in their original checkpoints' names,
  q/k/v fused as those checkpoints hold them (`families/flow_base.py`, `families/flux.py`).
- `peft`: what diffusers' `save_lora_weights` writes today: peft's `<module>.lora_A.weight` /
  `.lora_B.weight` under `unet.` / `transformer.` / `text_encoder.` / `text_encoder_2.`, plus the adapter
  config in the header; loadable with `pipeline.load_lora_weights`.
Both carry ModelSpec and kohya metadata (`lora_metadata.py`); `lora_reading.py` reads the SD families'
layouts back (including those earlier versions wrote).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from modules.config.train_config import TrainingConfig

from modules.util.atomic import save_safetensors_atomically

from .bundle import ModelBundle, checkpoint_text_encoder_key
from .files import resolve_save_dtype
from .kohya_lora import split_peft_key  # noqa: F401 - the families read adapter keys through lora
from .lora_metadata import file_metadata

TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
"""The attention projections of CLIP text encoders, as the diffusers LoRA training scripts target."""

LORA_FORMATS = ("kohya", "peft")


def add_lora(bundle: ModelBundle, training_cfg: TrainingConfig) -> list[nn.Parameter]:
    """Attach LoRA adapters and return their parameters (fp32, trainable); the base stays frozen.

    The LoRA "B" matrices start at zero (peft's gaussian init), so the model's output is unchanged
    until the first optimizer step. The text encoders the family trains (never T5) get adapters when
    `train_text_encoder` is set.
    """
    from peft import LoraConfig

    def config(targets: list[str]) -> "LoraConfig":
        return LoraConfig(
            r=training_cfg.lora_rank, lora_alpha=training_cfg.lora_alpha,
            lora_dropout=training_cfg.lora_dropout, target_modules=list(targets),
            init_lora_weights="gaussian",
        )

    if training_cfg.lora_rank < 1:
        raise ValueError(f"training.lora_rank is {training_cfg.lora_rank}; it must be at least 1")
    targets = list(training_cfg.lora_target_modules)
    if not targets:
        raise ValueError("training.lora_target_modules is empty; name at least one UNet module, e.g. to_q")
    targets = adapted_layers(bundle.denoiser, targets) or targets  # none found: peft's own error names them
    try:
        bundle.denoiser.add_adapter(config(targets))
    except ValueError as error:
        raise ValueError(
            f"training.lora_target_modules {targets} matched no {bundle.denoiser_name} module ({error}); "
            "use names such as to_q, to_k, to_v, to_out.0, ff.net.0.proj"
        ) from error
    adapted = [bundle.denoiser]
    if training_cfg.train_text_encoder:
        for encoder in bundle.trainable_text_encoders():
            _add_text_encoder_adapter(encoder, config(TEXT_ENCODER_TARGETS))
            adapted.append(encoder)

    params = []
    for module in adapted:
        for name, param in module.named_parameters():
            if ".lora_" in name:
                # Tiny updates to low-precision adapters would round away: keep them fp32.
                param.data = param.data.to(torch.float32)
                param.requires_grad_(True)
                params.append(param)
    if training_cfg.precision in ("bf16", "fp16"):
        _skip_input_casts(adapted)
    return params


ADAPTABLE_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)
"""The layer types an adapter attaches to (what peft adapts)."""


def adapted_layers(module: nn.Module, names) -> list[str]:
    """The paths of the layers that target `names` adapt: every Linear, convolution or embedding whose path
    is a name or ends in `.<name>` (peft's rule for a list of names). peft also matches containers and then
    refuses them; resolving to layers first lets a name mean "these layers" wherever a container shares
    it: Flux.2's `attn.to_out` is a Linear in single blocks and a ModuleList around `to_out.0` in double
    blocks, so `attn.to_out` adapts the single blocks' fused output projections only. Empty when no layer
    matches (the caller lets peft say so)."""
    names = list(names)
    return [path for path, layer in module.named_modules() if isinstance(layer, ADAPTABLE_LAYERS)
            and any(path == name or path.endswith("." + name) for name in names)]


def _skip_input_casts(modules: list[nn.Module]) -> None:
    """Let half-precision activations reach the fp32 adapters as they are, when training under autocast.

    peft casts each adapted layer's input to the adapter's dtype (fp32) before the LoRA matmuls, and
    autocast casts it straight back to bf16/fp16 for them: two copies of the activation per layer,
    and their two backward copies, that change no value (the half-precision value survives the round
    trip exactly). On a UNet with adapters on every attention projection those are hundreds of extra
    kernels per step, and a LoRA step is short enough that launching kernels is what limits it.
    Autocast is in force wherever adapters run with a half-precision base: training (the config
    check requires it) and sampling (`sampling._autocast_for`).
    """
    for module in modules:
        for layer in module.modules():
            if hasattr(layer, "cast_input_dtype_enabled"):
                layer.cast_input_dtype_enabled = False


def _add_text_encoder_adapter(encoder: nn.Module, config) -> None:
    """Inject LoRA into a transformers text encoder through peft directly.

    transformers' own `add_adapter` would do the same but refuses peft versions older than the one
    it was released with; peft's injector has no such check. `peft_config` is recorded the way
    transformers records it, so peft's and diffusers' helpers find the adapter.
    """
    from peft import inject_adapter_in_model

    if getattr(encoder, "peft_config", None):
        raise ValueError(f"{type(encoder).__name__} already has a LoRA adapter")
    inject_adapter_in_model(config, encoder, adapter_name="default")
    encoder.peft_config = {"default": config}
    encoder._hf_peft_config_loaded = True


def lora_modules(bundle: ModelBundle) -> dict[str, dict[str, torch.Tensor]]:
    """LoRA weights by component (`unet` or `transformer`, `text_encoder`, ...), in peft key layout
    (`<module path>.lora_A.weight` / `.lora_B.weight`, adapter name removed)."""
    from peft.utils import get_peft_model_state_dict

    found = {}
    for name, module in bundle.modules().items():
        if getattr(module, "peft_config", None):
            state = get_peft_model_state_dict(module)
            if name.startswith("text_encoder"):
                state = {checkpoint_text_encoder_key(key): value for key, value in state.items()}
            if state:
                found[name] = state
    if not found:
        raise ValueError("the model has no LoRA adapters; call add_lora first")
    return found


def lora_state_dict(bundle: ModelBundle) -> dict[str, torch.Tensor]:
    """All LoRA weights as one flat dict with `unet.` / `transformer.` / `text_encoder.` prefixes (peft layout)."""
    return {
        f"{component}.{key}": value
        for component, state in lora_modules(bundle).items() for key, value in state.items()
    }


def lora_alpha_and_rank(bundle: ModelBundle, component: str | None = None) -> tuple[float, int]:
    config = bundle.modules()[component or bundle.denoiser_name].peft_config["default"]
    return float(config.lora_alpha), int(config.r)


def save_lora(
    bundle: ModelBundle,
    path: str | Path,
    fmt: str = "kohya",
    dtype: str | torch.dtype = "fp16",
    metadata: dict | None = None,
    source=None,
) -> Path:
    """Write the LoRA weights to `path` (.safetensors) in `fmt` layout, atomically; returns the path.

    `source` (`streamed_save.TensorSource`): how sharded adapters are read - under sharded training every
    rank calls this, each adapter tensor is gathered whole (they are small) and only the writing rank writes."""
    if fmt not in LORA_FORMATS:
        raise ValueError(f"LoRA format {fmt!r} is not one of {', '.join(LORA_FORMATS)}")
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"LoRA output {path} must end in .safetensors")
    torch_dtype = resolve_save_dtype(dtype)
    modules = lora_modules(bundle)
    if source is not None:
        modules = {c: {k: source.whole(v.detach()) for k, v in state.items()} for c, state in modules.items()}
        if not source.writes:
            return path
    if fmt == "kohya":
        alphas = {component: lora_alpha_and_rank(bundle, component)[0] for component in modules}
        tensors = bundle.family.kohya_lora_tensors(bundle, modules, alphas)
    else:
        tensors = _peft_tensors(modules)
    tensors = {k: v.detach().to("cpu", torch_dtype) for k, v in tensors.items()}
    header = _header(bundle, fmt, modules, path.name.removesuffix(".safetensors"), metadata or {})
    return save_safetensors_atomically(tensors, path, header)


def _peft_tensors(modules: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    # What diffusers' `save_lora_weights` writes: peft's `lora_A` / `lora_B` names under the component.
    # (The older `lora.down` / `lora_linear_layer` names that `convert_state_dict_to_diffusers` gives are
    # read by the UNet pipelines only: `StableDiffusion3Pipeline` drops the transformer's attention
    # adapters when the text encoders' keys come in that older form.)
    return {f"{component}.{key}": value for component, state in modules.items() for key, value in state.items()}


def _header(bundle: ModelBundle, fmt: str, modules: dict, title: str, metadata: dict) -> dict[str, str]:
    alpha, rank = lora_alpha_and_rank(bundle)
    header = {"format": "pt", **file_metadata(bundle, fmt, rank, alpha, title)}
    if fmt == "peft":
        # diffusers reads rank/alpha back from here; without it, it would assume alpha == rank.
        from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

        adapter_configs = {}
        for component in modules:
            config = bundle.modules()[component].peft_config["default"].to_dict()
            for key, value in config.items():
                adapter_configs[f"{component}.{key}"] = sorted(value) if isinstance(value, set) else value
        header[LORA_ADAPTER_METADATA_KEY] = json.dumps(adapter_configs, indent=2, sort_keys=True, default=str)
    for key, value in metadata.items():
        header[str(key)] = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return header
