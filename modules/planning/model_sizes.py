"""What a model is made of - every weight's name and shape - read without loading it or importing torch.

The memory plan (`memory_need.py`, `memory_plan.py`) needs each part's parameter count, the shapes the
LoRA targets resolve to, which weights an fp8 base stores in one byte (the Linear layers') and how large
FSDP's units (the repeated blocks) are. All of it follows from the weights' names and shapes, which
come, fastest first, from:

1. a diffusers folder's own files: each `.safetensors` file starts with a JSON header naming every
   tensor with its dtype and shape, so a 40 GB transformer is sized by reading a few hundred kilobytes;
2. the published sizes Tandem ships (`modules/model/configs/sizes/`) for the real-size configs a single
   file or the benchmark is built from, found by a fingerprint of the component's config (a family with
   several published sizes - Flux.2 dev and Klein - by the size whose parameter count a file has);
3. sizes measured earlier on this machine (`$TANDEM_HOME/sizes/`, else `<repo>/.cache/sizes/`), same format;
4. the caller's `measure` - building the network on PyTorch's `meta` device (shapes only; importing
   diffusers and building a 20 B transformer takes seconds), whose result is kept as in 3.

Nothing here imports torch, so the GUI and the launcher's checks can plan without it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from modules.families.registry import FAMILIES, family_of_keys, guess_family

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "modules" / "model" / "configs"
"""The real-size configs Tandem ships, one folder per family (what single files are built from)."""
SHIPPED_SIZES_DIR = CONFIGS_DIR / "sizes"
COMPONENTS = ("unet", "transformer", "transformer_2", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")
"""The parts a folder's sizes are read from; `transformer_2` is Wan 2.2 A14B's second expert (one of the two
trains, `model.wan_expert`; the other is frozen, see `memory_need.frozen_expert_bytes`)."""
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
# Integer tensors in a file are buffers (CLIP's position ids), never trained parameters.
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_IGNORED_CONFIG_KEYS = ("_diffusers_version", "_name_or_path", "_commit_hash", "transformers_version",
                        "torch_dtype", "dtype")

Shape = tuple[int, ...]


class SizesUnavailable(ValueError):
    """The model cannot be sized without building it (no `measure` given) or at all; the message says why."""


@dataclass(frozen=True)
class Component:
    """One part of the model: its class and every parameter's name and shape."""
    class_name: str
    tensors: dict[str, Shape]

    @property
    def params(self) -> int:
        return sum(numel(s) for s in self.tensors.values())

    def can_train(self) -> bool:
        """Whether Tandem trains this text encoder when asked to: only CLIP encoders do (T5 and the language
        models of the newer families stay frozen)."""
        return self.class_name.startswith("CLIP")


@dataclass(frozen=True)
class ModelSizes:
    family: str
    source: str
    """Where the shapes came from, for the report (`diffusers folder X`, `published sizes of ...`)."""
    components: dict[str, Component]
    denoiser_config: dict = field(default_factory=dict)
    """The denoiser's config (hidden size, blocks): what the activation estimate reads."""

    @property
    def denoiser_name(self) -> str:
        return "unet" if "unet" in self.components else "transformer"

    @property
    def denoiser(self) -> Component:
        return self.components[self.denoiser_name]

    def text_encoders(self) -> list[str]:
        return [n for n in TEXT_ENCODERS if n in self.components]


def numel(shape: Shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------- what the names say
def layers(tensors: dict[str, Shape]) -> dict[str, Shape]:
    """The weight shape of every layer an adapter can attach to (Linear, convolution, embedding: the modules
    with a weight of 2 or more dimensions), by the layer's path."""
    return {name[:-len(".weight")]: shape for name, shape in tensors.items()
            if name.endswith(".weight") and len(shape) >= 2}


def lora_shapes(tensors: dict[str, Shape], targets, rank: int) -> list[Shape]:
    """The shapes of the LoRA down/up matrices on the layers `targets` adapt: a layer whose path is a target
    or ends in `.<target>` (`modules.model.lora.adapted_layers`, peft's rule for a list of names)."""
    shapes: list[Shape] = []
    for path, shape in layers(tensors).items():
        if any(path == t or path.endswith("." + t) for t in targets):
            if len(shape) == 2:
                shapes += [(rank, shape[1]), (shape[0], rank)]
            else:
                shapes += [(rank, *shape[1:]), (shape[0], rank, *([1] * (len(shape) - 2)))]
    return shapes


def linear_weights(tensors: dict[str, Shape]) -> tuple[int, int]:
    """(elements, layers) of the 2-D weights: the Linear layers `model.unet_dtype = fp8` stores in float8."""
    found = [numel(s) for name, s in tensors.items() if name.endswith(".weight") and len(s) == 2]
    return sum(found), len(found)


# FSDP's units (`family.repeated_blocks`, `family.text_encoder_blocks`), told by their names: a UNet's
# ResNet and transformer blocks; a transformer's repeated blocks (each element of the module lists its
# family's `block_groups` names: `transformer_blocks.3`, `single_transformer_blocks.12`, `layers.5`; of any
# top-level module list where no family says); a text encoder's layers.
_UNET_UNIT = re.compile(r"^(.*?(?:^|\.)(?:resnets|transformer_blocks)\.\d+)\.")
_TRANSFORMER_UNIT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*\.\d+)\.")
_ENCODER_UNIT = re.compile(r"^(.*\.layers\.\d+)\.")


def units(tensors: dict[str, Shape], kind: str, groups: tuple[str, ...] = ()) -> dict[str, int]:
    """Parameters of each FSDP unit of a part (`kind`: `unet`, `transformer` or `text_encoder`), by unit;
    `groups`: a transformer's block lists (`FamilyInfo.block_groups`)."""
    pattern = {"unet": _UNET_UNIT, "transformer": _TRANSFORMER_UNIT}.get(kind, _ENCODER_UNIT)
    if kind == "transformer" and groups:
        pattern = re.compile(rf"^((?:{'|'.join(map(re.escape, groups))})\.\d+)\.")
    found: dict[str, int] = {}
    for name, shape in tensors.items():
        match = pattern.match(name)
        if match:
            found[match.group(1)] = found.get(match.group(1), 0) + numel(shape)
    return found


def unit_kinds(tensors: dict[str, Shape], groups: tuple[str, ...] = ()) -> dict[str, int]:
    """A transformer's repeated blocks by kind: `{"transformer_blocks": 19, "single_transformer_blocks": 38}`."""
    kinds: dict[str, int] = {}
    for unit in units(tensors, "transformer", groups):
        kind = unit.rsplit(".", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


# ---------------------------------------------------------------------------- reading files
def read_header(path: Path) -> dict[str, tuple[str, Shape]]:
    """Tensor name -> (dtype, shape) from a .safetensors header (8-byte length, then JSON)."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if not 0 < length < 100_000_000:
            raise SizesUnavailable(f"{path}: not a .safetensors file (its header length is {length})")
        header = json.loads(file.read(length))
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


def _weight_files(folder: Path) -> list[Path]:
    """The .safetensors files holding one component's weights: its index's shards, the plain file, or one
    variant's files (`*.fp16.safetensors`) - never two variants of the same weights."""
    for index in sorted(folder.glob("*.safetensors.index.json")):
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    plain = [f for f in files if f.name in ("diffusion_pytorch_model.safetensors", "model.safetensors")]
    if plain:
        return plain[:1]
    variants: dict[str, list[Path]] = {}
    for f in files:
        variants.setdefault(".".join(f.name.split(".")[1:-1]), []).append(f)
    return next(iter(variants.values()), [])


def _class_name(config: dict) -> str:
    return str(config.get("_class_name") or next(iter(config.get("architectures") or ()), ""))


def component_from_files(folder: Path, config: dict) -> Component | None:
    """A component of a diffusers folder from its files' headers; None when it has no .safetensors file."""
    files = _weight_files(folder)
    if not files:
        return None
    tensors: dict[str, Shape] = {}
    for f in files:
        tensors.update({k: shape for k, (dtype, shape) in read_header(f).items() if dtype in _FLOAT_DTYPES})
    name = _class_name(config) or ("CLIPTextModel" if any(k.startswith("text_model.") for k in tensors) else "")
    return Component(name, tensors)


def fingerprint(config: dict) -> str:
    """What identifies an architecture: its config without the fields that name versions or paths."""
    kept = {k: v for k, v in config.items() if k not in _IGNORED_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    home = os.environ.get("TANDEM_HOME")
    return (Path(home) if home else REPO_ROOT / ".cache") / "sizes"


def _compact(tensors: dict[str, Shape]) -> dict:
    """`tensors` with the numbers in names factored out: `{"blocks.*.attn.to_q.weight": [[shape, [[0], [1],
    ...]]]}` - each name pattern once, with the indexes of each shape (a 12 B transformer's 1,000 names
    become about 40 patterns)."""
    groups: dict[str, dict[Shape, list[list[int]]]] = {}
    for name, shape in tensors.items():
        segments = name.split(".")
        pattern = ".".join("*" if s.isdigit() else s for s in segments)
        groups.setdefault(pattern, {}).setdefault(tuple(shape), []).append([int(s) for s in segments if s.isdigit()])
    return {"groups": {pattern: [[list(shape), indexes] for shape, indexes in by_shape.items()]
                       for pattern, by_shape in groups.items()}}


def _expand(data: dict) -> dict[str, Shape]:
    tensors: dict[str, Shape] = {}
    for pattern, by_shape in data["groups"].items():
        for shape, indexes in by_shape:
            for index in indexes:
                numbers = iter(index)
                tensors[".".join(str(next(numbers)) if s == "*" else s for s in pattern.split("."))] = tuple(shape)
    return tensors


def stored_component(config: dict) -> Component | None:
    """A component sized before: shipped with Tandem or measured on this machine (by `fingerprint`)."""
    key = fingerprint(config)
    for folder in (SHIPPED_SIZES_DIR, cache_dir()):
        path = folder / f"{key}.json"
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                return Component(data["class_name"], _expand(data))
            except (OSError, ValueError, KeyError):
                continue  # a damaged cache entry is measured again
    return None


def store_component(config: dict, component: Component, folder: Path | None = None) -> Path | None:
    """Keep a measured component for next time (`folder`: the cache, or the shipped sizes when writing
    those). Never raises for an unwritable cache: sizing again is only slower."""
    folder = folder or cache_dir()
    path = folder / f"{fingerprint(config)}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"class_name": component.class_name, **_compact(component.tensors)},
                                  separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


# ---------------------------------------------------------------------------- a config's model
Measure = Callable[[dict[str, dict]], dict[str, Component]]
"""Builds components from their configs on `meta` (needs torch): `{name: config} -> {name: Component}`."""


def read_folder_configs(folder: Path) -> dict[str, dict]:
    found = {}
    for part in COMPONENTS:
        path = folder / part / "config.json"
        if path.is_file():
            found[part] = json.loads(path.read_text(encoding="utf-8"))
    if "unet" not in found and "transformer" not in found:
        raise SizesUnavailable(f"{folder} has no unet/config.json or transformer/config.json; model.base_model must "
                               "be a diffusers folder, a single .safetensors/.ckpt file or a builtin: model.")
    return found


def counted_parts(family: str, parts):
    """The parts of `family`'s model a GPU holds beside its denoiser: all of them, except a text encoder loaded
    apart (`FamilyInfo.text_apart`: Qwen-Image's, Z-Image's), which fills the text cache before the denoiser
    loads and is freed (`modules/trainer/text_encoding.py`)."""
    apart = family in FAMILIES and FAMILIES[family].text_apart
    return [p for p in parts if not (apart and p in TEXT_ENCODERS)]


def shipped_configs(family: str, variant: str = "") -> dict[str, dict]:
    """The real-size component configs Tandem ships for `family` (modules/model/configs/<family>/): its
    default size, or `variant`'s (`transformer_<variant>.json` where it has its own), of the parts counted."""
    def path(part: str) -> Path:
        own = CONFIGS_DIR / family / f"{part}_{variant}.json"
        return own if variant and own.is_file() else CONFIGS_DIR / family / f"{part}.json"
    return {part: json.loads(path(part).read_text(encoding="utf-8"))
            for part in counted_parts(family, COMPONENTS) if path(part).is_file()}


def _file_variant(family: str, path: Path) -> str:
    """The published size of `family` the single file `path` is (`FamilyInfo.variants`: Flux.2 dev or Klein):
    the one whose denoiser's parameter count is nearest the file's; '' (the default size) for a family of one
    size, or a file whose header cannot be read."""
    variants = FAMILIES[family].variants if family in FAMILIES else ()
    if not variants:
        return ""
    try:
        file_params = sum(numel(shape) for dtype, shape in read_header(path).values() if dtype in _FLOAT_DTYPES)
    except (OSError, ValueError):  # SizesUnavailable too: sized as the default size
        return ""
    counts = {}
    for variant in variants:
        configs = shipped_configs(family, variant if variant != variants[0] else "")
        denoiser = configs.get("transformer") or configs.get("unet")
        stored = stored_component(denoiser) if denoiser is not None else None
        if stored is not None:
            counts[variant if variant != variants[0] else ""] = stored.params
    return min(counts, key=lambda v: abs(counts[v] - file_params)) if counts else ""


def sizes_from_configs(family: str, source: str, configs: dict[str, dict], folder: Path | None,
                       measure: Measure | None) -> ModelSizes:
    """Every counted component (`counted_parts`): from the folder's files, else stored sizes, else `measure`
    (then stored)."""
    configs = {part: config for part, config in configs.items() if part in counted_parts(family, configs)}
    components: dict[str, Component] = {}
    missing: dict[str, dict] = {}
    for part, config in configs.items():
        found = component_from_files(folder / part, config) if folder is not None else None
        found = found or stored_component(config)
        if found is None:
            missing[part] = config
        else:
            components[part] = found
    if missing:
        if measure is None:
            raise SizesUnavailable(f"the {', '.join(missing)} of {source} must be built on `meta` to be sized "
                                   "(no weights file or stored sizes)")
        for part, component in measure(missing).items():
            store_component(missing[part], component)
            components[part] = component
        source += f" ({', '.join(missing)} built on meta)"
    denoiser = configs.get("unet") or configs.get("transformer") or {}
    return ModelSizes(family, source, {p: components[p] for p in configs}, dict(denoiser))


def built_in_folder(family: str) -> Path | None:
    """A built-in model's folder where it was built already (`modules.model.demo.default_demo_root`'s names:
    `demo-model` for SD, `demo-<family>` for the others), else None: reading it needs no torch."""
    home = os.environ.get("TANDEM_HOME")
    folder = (Path(home) if home else REPO_ROOT / ".cache") / FAMILIES[family].demo_folder
    return folder if (folder / "model_index.json").is_file() else None


def _folder_family(folder: Path, model_type: str, configs: dict[str, dict]) -> str:
    family = model_type if model_type in FAMILIES else guess_family(str(folder))
    if family is None:
        raise SizesUnavailable(f"{folder}: its model_index.json names no pipeline Tandem trains; set model.model_type")
    if family == "sd1" and configs.get("unet", {}).get("cross_attention_dim") == 1024:
        return "sd2"  # SD 1.x and 2.x share a pipeline; 2.x's UNet attends to OpenCLIP-H's 1024 channels
    return family


def model_sizes(cfg, measure: Measure | None = None, builtin_folder: Callable[[str], Path] | None = None) -> ModelSizes:
    """The sizes of `cfg.model`'s model. `measure` builds what no file or stored size describes; a built-in
    model is read from its folder, which `builtin_folder(family)` builds where it does not exist yet.
    Without them, raises `SizesUnavailable` where they would be needed."""
    base, model_type = cfg.model.base_model.strip(), cfg.model.model_type
    family = guess_family(base, model_type)
    builtin = next((name for name, info in FAMILIES.items() if info.demo and info.demo == base), None)
    if builtin is not None:
        folder = built_in_folder(builtin)
        if folder is None:
            if builtin_folder is None:
                raise SizesUnavailable(f"the built-in model {base} is sized from its folder, built on first use")
            folder = Path(builtin_folder(builtin))
        return sizes_from_configs(builtin, f"built-in model ({folder})", read_folder_configs(folder), folder, measure)
    path = Path(base).expanduser()
    if path.is_dir():
        configs = read_folder_configs(path)
        return sizes_from_configs(_folder_family(path, model_type, configs), f"diffusers folder {path}", configs,
                                  path, measure)
    single_file = path.suffix.lower() == ".safetensors" and path.is_file()
    if family is None and single_file:
        family = family_of_keys(list(read_header(path)))
    if family is None:
        if not path.is_file():
            raise SizesUnavailable(f"model.base_model: {base!r} does not exist and model.model_type is auto; fix the "
                                   "path or set model.model_type.")
        raise SizesUnavailable(f"model.model_type is auto and {path} is not recognised from its tensor names; set "
                               "model.model_type")
    variant = _file_variant(family, path) if single_file else ""
    configs = shipped_configs(family, variant)
    if not configs:
        raise SizesUnavailable(f"model.model_type: no real-size configs are shipped for {family!r}")
    title = FAMILIES[family].title if family in FAMILIES else family
    title += f" {variant}" if variant else ""
    return sizes_from_configs(family, f"published sizes of {title} ({CONFIGS_DIR / family})", configs, None, measure)
