"""The LoRA tools kohya_ss users know: merge a LoRA into its base model, extract a LoRA from a fine-tune and
its base; resizing a LoRA's rank is `lora_resize.py` (it needs no base model). `scripts/lora_tools.py` and the
GUI's Tools tab run them.

- `merge`: W + strength x (alpha / rank) x up @ down for every adapted layer of a plain LoRA in any layout
  `lora_reading.read_lora` reads (Tandem's, kohya/ComfyUI, diffusers/peft), written as a diffusers folder or
  one single-file checkpoint (`saving.py`).
- `extract`: the best rank-r approximation (SVD) of fine-tuned minus base for every Linear (and with `conv`,
  every Conv2d) of the denoiser - and of a text encoder's attention projections when it was trained too -
  written as Tandem writes a trained LoRA (`lora.save_lora`: either layout, with its metadata).

Both work layer by layer: the model waits on the CPU in the output's dtype, one layer at a time goes to the
device as fp32, and the loops show tqdm's bar and call `progress(done, total, what)`. Bad input raises
`ToolError`, one line that names the file and the fix; an output that exists is replaced only with
`overwrite`, and every output is written atomically (whole or not at all).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from modules.config.train_config import ModelConfig, TrainingConfig

from .lora_tool_parts import (ALPHA, LayerEnergy, Progress, ToolError, free_output, kept_energy,
                              pick_device, read_plain_lora, steps)

TEXT_ENCODER_MIN_DIFF = 0.01
"""A text encoder counts as trained when one of its adapted weights moved more than this (kohya's
`min_diff`): a fine-tune saved in a lower precision than its base differs from it by rounding everywhere."""


@dataclass
class MergeReport:
    output: Path
    layers: int
    strength: float

    def line(self) -> str:
        return f"Merged {self.layers} layers at strength {self.strength:g} into {self.output}"


@dataclass
class ExtractReport:
    output: Path
    rank: int
    layers: list[LayerEnergy] = field(default_factory=list)
    text_encoders: list[str] = field(default_factory=list)
    too_small: list[str] = field(default_factory=list)
    """Convolutions left out: they cannot hold the rank (a model's 4-channel output convolution, say)."""

    def line(self) -> str:
        kept = [layer.kept for layer in self.layers]
        encoders = f" and {', '.join(self.text_encoders)}" if self.text_encoders else ""
        left = (f"; left out {len(self.too_small)} convolution(s) smaller than the rank ({', '.join(self.too_small[:3])})"
                if self.too_small else "")
        return (f"Extracted rank {self.rank} from {len(kept)} layers{encoders} into {self.output}; kept energy "
                f"min {min(kept):.3f}, mean {sum(kept) / len(kept):.3f}{left}")


# ---------------------------------------------------------------------------- shared steps


def load_base(model: str, dtype: str, role: str):
    """The model `model` (a diffusers folder, a single file or a `builtin:` name) with every part in `dtype`,
    on the CPU; a model that cannot be read is a `ToolError` naming it and its `role`."""
    from .loading import load_model

    try:
        return load_model(ModelConfig(base_model=model, unet_dtype=dtype, text_encoder_dtype=dtype, vae_dtype=dtype))
    except (ValueError, OSError, RuntimeError) as error:
        raise ToolError(f"{model}: cannot be read as the {role} ({_first_line(error)}); choose a diffusers folder, "
                        "a single .safetensors checkpoint or builtin:demo") from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def layer_of(bundle, component: str, module_path: str) -> nn.Module:
    """The layer `module_path` of `component`; text-encoder paths as checkpoints spell them (`text_model.`)."""
    module = bundle.modules()[component]
    own = module_path
    if component.startswith("text_encoder") and not hasattr(module, "text_model"):
        own = module_path.removeprefix("text_model.")  # transformers 5 dropped the wrapper files still name
    return module.get_submodule(own)


def low_rank(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(up, down, singular values) with up @ down the best rank-`rank` approximation of `matrix` (2-D), the
    singular values split evenly between the two factors; all singular values come back."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    root = s[:rank].sqrt()
    return u[:, :rank] * root, root[:, None] * vh[:rank], s


def as_matrix(up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """up @ down of a LoRA pair as one 2-D matrix (out, in x kernel): Linear and convolution pairs alike."""
    return up.flatten(1) @ down.flatten(1)


# ---------------------------------------------------------------------------- merge


def merge(base_model: str, lora: str | Path, output: str | Path, strength: float = 1.0, dtype: str = "fp16",
          device: str | None = None, overwrite: bool = False, progress: Progress | None = None) -> MergeReport:
    """Merge the LoRA file `lora` into `base_model` at `strength` and write the merged model to `output`: a
    single-file checkpoint when it ends in .safetensors, else a diffusers folder; weights in `dtype`."""
    import tempfile

    from safetensors.torch import save_file

    from .lora_reading import read_lora
    from .saving import save_full_diffusers, save_full_single_file

    single = Path(output).suffix.lower() == ".safetensors"
    out = free_output(output, overwrite)
    lora = _lora_file(lora)
    device = pick_device(device)
    tensors = _one_scale(lora)
    bundle = load_base(base_model, dtype, "base model")
    with tempfile.TemporaryDirectory(prefix="tandem-merge-") as folder:
        # The reader knows every layout's module names; it is given the file with one rank and scale 1.
        plain = Path(folder) / lora.name
        save_file(tensors, str(plain))
        try:
            weights = read_lora(plain, bundle)
        except ValueError as error:
            raise ToolError(_lora_problem(plain, error, base_model).replace(str(plain), str(lora))) from None
    pairs = [(component, module, state) for component, state in weights.state.items()
             for module in sorted({key.rsplit(".lora_", 1)[0] for key in state})]
    with torch.no_grad():
        for component, module, state in steps(pairs, "merging", progress):
            scale = weights.alpha[component] / weights.rank[component]  # 1: `_one_scale` folded it in
            _merge_layer(bundle, component, module, state, strength * scale, device, lora, base_model)
    (save_full_single_file if single else save_full_diffusers)(bundle, out, dtype)
    return MergeReport(out, len(pairs), strength)


def _one_scale(lora: Path) -> dict[str, torch.Tensor]:
    """The plain LoRA `lora` with each module's alpha / rank multiplied into its up matrix and every module
    padded with zeros to the largest rank: the same changes, read with one rank and alpha = rank. (Files of
    mixed ranks or alphas - kohya's dynamic resize, `lora_resize` - are refused by the trainer's reader.)"""
    tensors, _, modules = read_plain_lora(lora, "merge")
    rank = max(tensors[m.down_key].shape[0] for m in modules)
    for m in modules:
        down, up = tensors[m.down_key].float(), tensors[m.up_key].float()
        missing = rank - down.shape[0]
        up = up * (m.alpha / down.shape[0])
        tensors[m.down_key] = torch.cat([down, down.new_zeros(missing, *down.shape[1:])]).contiguous()
        tensors[m.up_key] = torch.cat([up, up.new_zeros(up.shape[0], missing, *up.shape[2:])], dim=1).contiguous()
        if m.name + ALPHA in tensors:
            tensors[m.name + ALPHA] = torch.tensor(float(rank))
    return tensors


def _lora_file(path: str | Path) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ToolError(f"{file}: no such file; choose the LoRA's .safetensors file")
    return file


def _lora_problem(lora: Path, error: Exception, base_model: str) -> str:
    text = _first_line(error).removeprefix(f"{lora}: ")
    if "is neither a kohya key" in text:
        return f"{lora}: is not a LoRA of this model ({text}); choose a LoRA file made for {base_model}"
    return f"{lora}: {text}" if base_model in text else f"{lora}: {text} (base model: {base_model})"


def _merge_layer(bundle, component: str, module: str, state: dict, factor: float, device: str, lora: Path,
                 base_model: str) -> None:
    down, up = state.get(f"{module}.lora_A.weight"), state.get(f"{module}.lora_B.weight")
    if down is None or up is None:
        raise ToolError(f"{lora}: {component} module {module!r} lacks its {'down' if down is None else 'up'} "
                        "matrix; the file is incomplete")
    try:
        layer = layer_of(bundle, component, module)
    except AttributeError:
        raise ToolError(f"{lora}: names {component} module {module!r}, which {base_model} lacks; choose the base "
                        "model the LoRA was trained on") from None
    weight = layer.weight
    delta = as_matrix(up.to(device, torch.float32), down.to(device, torch.float32))
    if delta.numel() != weight.numel() or delta.shape[0] != weight.shape[0]:
        raise ToolError(f"{lora}: {component} module {module!r} is {tuple(delta.shape)} in the LoRA and "
                        f"{tuple(weight.shape)} in {base_model}; choose the base model the LoRA was trained on")
    merged = weight.to(device, torch.float32) + factor * delta.reshape(weight.shape)
    weight.copy_(merged.to(weight.device, weight.dtype))


# ---------------------------------------------------------------------------- extract


def extract(base_model: str, tuned_model: str, output: str | Path, rank: int, alpha: float | None = None,
            fmt: str = "kohya", dtype: str = "fp16", conv: bool = False, device: str | None = None,
            overwrite: bool = False, progress: Progress | None = None, load_dtype: str = "fp32") -> ExtractReport:
    """A LoRA of `rank` (and `alpha`, the rank by default) that turns `base_model` into `tuned_model` as
    closely as that rank allows, written to `output` (.safetensors) in `fmt` (`kohya` or `peft`). Both models
    wait on the CPU in `load_dtype` (bf16 halves the memory); each layer's difference is taken in fp32."""
    from .lora import TEXT_ENCODER_TARGETS, add_lora, save_lora
    from .lora_reading import LoraWeights, apply_lora

    if rank < 1:
        raise ToolError(f"--rank is {rank}; a LoRA's rank is at least 1")
    out = free_output(output, overwrite, single_file=True)
    device = pick_device(device)
    alpha = float(alpha or rank)
    base = load_base(base_model, load_dtype, "base model")
    tuned = load_base(tuned_model, load_dtype, "fine-tuned model")
    if base.model_type != tuned.model_type:
        raise ToolError(f"{tuned_model}: is an {tuned.model_type.upper()} model and {base_model} an "
                        f"{base.model_type.upper()} one; choose the base model it was fine-tuned from")
    kinds = (nn.Linear, nn.Conv2d) if conv else (nn.Linear,)
    plan = [(base.denoiser_name, path) for path, layer in base.denoiser.named_modules() if isinstance(layer, kinds)]
    # A convolution too small for the rank is left out, as kohya's LoCon leaves a model's outer convolutions out.
    too_small = [path for _, path in plan if isinstance(base.denoiser.get_submodule(path), nn.Conv2d)
                 and rank > min(base.denoiser.get_submodule(path).weight.flatten(1).shape)]
    plan = [(component, path) for component, path in plan if path not in too_small]
    trained_encoders = [_component(base, encoder) for encoder in base.trainable_text_encoders()
                        if _moved(base, tuned, _component(base, encoder), TEXT_ENCODER_TARGETS)]
    for component in trained_encoders:
        plan += [(component, path) for path in _encoder_layers(base.modules()[component], TEXT_ENCODER_TARGETS)]
    state: dict[str, dict[str, torch.Tensor]] = {}
    report = ExtractReport(out, rank, text_encoders=trained_encoders, too_small=too_small)
    with torch.no_grad():
        for component, path in steps(plan, "extracting", progress):
            up, down, kept = _extract_layer(base, tuned, component, path, rank, alpha, device, base_model, tuned_model)
            key = _checkpoint_path(component, path)
            state.setdefault(component, {}).update({f"{key}.lora_A.weight": down, f"{key}.lora_B.weight": up})
            if component == base.denoiser_name:
                report.layers.append(LayerEnergy(f"{component}.{path}", rank, rank, kept))
    del tuned
    targets = [path for component, path in plan if component == base.denoiser_name]
    add_lora(base, TrainingConfig(precision="fp32", lora_rank=rank, lora_alpha=alpha, lora_target_modules=targets,
                                  train_text_encoder=bool(trained_encoders)))
    ranks = {component: rank for component in state}
    apply_lora(base, LoraWeights(state, {c: alpha for c in state}, ranks, fmt, {}))
    names = {"tandem_extracted_from": Path(tuned_model).name, "tandem_extract_base": Path(base_model).name}
    save_lora(base, out, fmt, dtype, names)
    return report


def _component(bundle, module: nn.Module) -> str:
    return next(name for name, m in bundle.modules().items() if m is module)


def _encoder_layers(encoder: nn.Module, targets: list[str]) -> list[str]:
    from .lora import adapted_layers

    return adapted_layers(encoder, targets)


def _checkpoint_path(component: str, path: str) -> str:
    """A layer's path as LoRA files spell it: text encoders' under `text_model.`."""
    from .bundle import checkpoint_text_encoder_key

    if not component.startswith("text_encoder"):
        return path
    return checkpoint_text_encoder_key(path + ".weight").removesuffix(".weight")


def _moved(base, tuned, component: str, targets: list[str]) -> bool:
    """Whether a text encoder's adaptable weights differ between the two models by more than rounding."""
    mine, theirs = base.modules()[component], tuned.modules().get(component)
    if theirs is None:
        return False
    for path in _encoder_layers(mine, targets):
        try:
            other = theirs.get_submodule(path).weight
        except AttributeError:
            return False
        if other.shape == mine.get_submodule(path).weight.shape and \
                float((other.float() - mine.get_submodule(path).weight.float()).abs().max()) > TEXT_ENCODER_MIN_DIFF:
            return True
    return False


def _extract_layer(base, tuned, component: str, path: str, rank: int, alpha: float, device: str, base_model: str,
                   tuned_model: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(up, down, kept energy) of one layer, with alpha / rank folded out of the factors."""
    mine = base.modules()[component].get_submodule(path).weight
    try:
        theirs = tuned.modules()[component].get_submodule(path).weight
    except (AttributeError, KeyError):
        theirs = None
    if theirs is None or theirs.shape != mine.shape:
        raise ToolError(f"{tuned_model}: its {component} layer {path!r} does not match {base_model}'s; choose the "
                        "base model it was fine-tuned from")
    delta = (theirs.to(device, torch.float32) - mine.to(device, torch.float32)).flatten(1)
    if rank > min(delta.shape):
        raise ToolError(f"--rank {rank} is larger than {component} layer {path!r} ({delta.shape[0]}x{delta.shape[1]}) "
                        f"can hold; choose --rank {min(delta.shape)} or less")
    up, down, singular = low_rank(delta, rank)
    root = (rank / alpha) ** 0.5  # alpha / rank scales up @ down when the LoRA is applied
    up = (up * root).reshape(mine.shape[0], rank, *([1] * (mine.dim() - 2)))
    down = (down * root).reshape(rank, *mine.shape[1:])
    return up.cpu(), down.cpu(), kept_energy(singular, rank)
