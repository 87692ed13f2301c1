"""What the LoRA tools share (`lora_tools.py`: merge, extract; `lora_resize.py`): the one-line error, the
progress loop, the output check, the kept-energy measure, and reading a plain LoRA file in either layout
without a base model (each module with its own alpha and rank).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import torch

Progress = Callable[[int, int, str], None]
T = TypeVar("T")


class ToolError(ValueError):
    """Bad input to a LoRA tool: one line naming the file and what to do."""


@dataclass
class LayerEnergy:
    """How much of a layer's change a low-rank version keeps: the share of its squared Frobenius norm."""
    module: str
    old_rank: int
    new_rank: int
    kept: float


def steps(items: Iterable[T], what: str, progress: Progress | None) -> Iterator[T]:
    """`items` with tqdm's bar (shown in a terminal only) and a `progress` call after each."""
    from tqdm import tqdm

    items = list(items)
    for done, item in enumerate(tqdm(items, desc=what, unit="layer", leave=False, disable=None), start=1):
        yield item
        if progress is not None:
            progress(done, len(items), what)


def free_output(output: str | Path, overwrite: bool, single_file: bool | None = None) -> Path:
    """The output path, refused when it exists (without `overwrite`) or has the wrong kind of name;
    `single_file`: True for a .safetensors file, False for a folder, None for either."""
    path = Path(output).expanduser()
    if single_file is True and path.suffix.lower() != ".safetensors":
        raise ToolError(f"{path}: a LoRA is written as a .safetensors file; end the output's name in .safetensors")
    if path.exists() and not overwrite:
        raise ToolError(f"{path} exists; choose another output, or replace it with --overwrite")
    if path.exists() and path.is_dir() != (path.suffix.lower() != ".safetensors"):
        raise ToolError(f"{path} exists and is {'a folder' if path.is_dir() else 'a file'}; choose another output")
    if not path.parent.is_dir():
        raise ToolError(f"{path}: the folder {path.parent} does not exist; create it or choose another output")
    return path


def pick_device(device: str | None) -> str:
    """`device`, or a GPU when there is one; a GPU asked for on a machine without one is a `ToolError`."""
    if not device:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ToolError(f"--device {device!r} is no device; use cpu or cuda") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ToolError(f"--device {device}: this machine has no CUDA GPU (or PyTorch was built without CUDA); "
                        "use --device cpu")
    return device


def kept_energy(singular_values: torch.Tensor, rank: int) -> float:
    """The share of the squared Frobenius norm the first `rank` singular values hold (1 for a zero matrix)."""
    energy = singular_values.double().square()
    total = float(energy.sum())
    return float(energy[:rank].sum()) / total if total > 0 else 1.0


PAIRS = ((".lora_down.weight", ".lora_up.weight"), (".lora_A.weight", ".lora_B.weight"),
         (".lora.down.weight", ".lora.up.weight"), (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight"))
"""(down, up) suffixes of a plain LoRA pair: kohya's, peft's, and diffusers' older spellings."""
ALPHA = ".alpha"
ADAPTER_METADATA = "lora_adapter_metadata"
VARIANT_MARKS = {"hada_": "LoHa", "lokr_": "LoKr", "dora_scale": "DoRA", "lora_magnitude_vector": "DoRA"}


@dataclass
class PlainModule:
    name: str
    down_key: str
    up_key: str
    alpha: float


def read_plain_lora(source: Path, tool: str) -> tuple[dict[str, torch.Tensor], dict[str, str], list[PlainModule]]:
    """The tensors, header and modules (each with its own alpha) of the plain LoRA file `source`, in either
    layout, without a base model; anything else is a `ToolError` for `tool`."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(source), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as error:
        raise ToolError(f"{source}: is not a .safetensors LoRA ({error}); choose a LoRA file") from None
    for mark, title in VARIANT_MARKS.items():
        if any(mark in key for key in tensors):
            raise ToolError(f"{source}: holds {title} weights; {tool} reads plain LoRA files (as kohya's tools do)")
    return tensors, metadata, _modules(source, tensors, metadata)


def _modules(source: Path, tensors: dict[str, torch.Tensor], metadata: dict) -> list[PlainModule]:
    configs = json.loads(metadata[ADAPTER_METADATA]) if ADAPTER_METADATA in metadata else {}
    found, used = [], set()
    for key in sorted(tensors):
        for down, up in PAIRS:
            if key.endswith(down):
                name = key[: -len(down)]
                if name + up not in tensors:
                    raise ToolError(f"{source}: {key!r} has no {up.lstrip('.')} partner; the file is incomplete")
                alpha = _alpha(name, tensors, configs, tensors[key].shape[0])
                found.append(PlainModule(name, key, name + up, alpha))
                used.update({key, name + up, name + ALPHA})
    strays = sorted(set(tensors) - used)
    if strays or not found:
        example = f" ({strays[0]!r} is no LoRA tensor)" if strays else ""
        raise ToolError(f"{source}: is not a LoRA file{example}; choose a LoRA in the kohya/ComfyUI or the "
                        "diffusers/peft layout")
    return found


def _alpha(name: str, tensors: dict, configs: dict, rank: int) -> float:
    """A module's alpha: its `.alpha` tensor, else its component's in the peft header (patterns first), else
    its rank (peft's and diffusers' default: scale 1)."""
    if name + ALPHA in tensors:
        return float(tensors[name + ALPHA])
    component, _, module = name.partition(".")
    pattern = configs.get(f"{component}.alpha_pattern") or {}
    if module in pattern:
        return float(pattern[module])
    value = configs.get(f"{component}.lora_alpha")
    return float(value) if value is not None else float(rank)
