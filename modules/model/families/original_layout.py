"""Diffusers <-> original ("single file") names of a transformer, written once as a table.

SD3.5 (Stability's `joint_blocks.*`) and Flux (Black Forest Labs' `double_blocks.*`) checkpoints store
some weights fused where diffusers keeps them apart: q, k and v in one `qkv` matrix, and in Flux's
single blocks q, k, v and the MLP input in one `linear1`. Their final norms also store (shift, scale)
where diffusers has (scale, shift). One table per family (`Entry` rows, built by `flux.py`/`sd3.py`)
describes that, and everything that needs the original names is derived from it:

- `to_original` / `from_original`: full weights, for single-file saves and loads;
- `lora_to_original` / `lora_from_original`: LoRA adapters in the kohya layout, fused the way the
  weights are (one `lora_down`/`lora_up` pair per original module, as sd-scripts writes them and
  ComfyUI applies them to the original weights).

The tables are checked against diffusers' own converters in the tests (`convert_*_checkpoint_to_diffusers`).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

LINEAR = (("weight", "weight"), ("bias", "bias"))
"""(original suffix, diffusers suffix) of a linear layer's parameters."""


@dataclass(frozen=True)
class Entry:
    """One original module and the diffusers modules it holds, stacked along dim 0 in `parts` order."""

    original: str
    """The original module path, e.g. `double_blocks.0.img_attn.qkv`."""
    parts: tuple[str, ...]
    """Diffusers module paths, e.g. (`transformer_blocks.0.attn.to_q`, `...to_k`, `...to_v`)."""
    params: tuple[tuple[str, str], ...] = LINEAR
    """(original suffix, diffusers suffix) for each parameter; an empty suffix names the module itself."""
    swap_halves: bool = False
    """The original stores the two halves of dim 0 the other way round (AdaLayerNormContinuous: shift, scale)."""

    def original_name(self, suffix: str) -> str:
        return f"{self.original}.{suffix}" if suffix else self.original

    @staticmethod
    def part_name(part: str, suffix: str) -> str:
        return f"{part}.{suffix}" if suffix else part


def joint_attention(image: str, text: str, block: str, q_norm: str, k_norm: str,
                    norm_params: tuple[tuple[str, str], ...]) -> list[Entry]:
    """The attention of a block where image and text tokens attend jointly (Flux's and Flux.2's double
    blocks, SD3's joint blocks): each stream's fused qkv, its q/k norms and its output projection.
    `image` and `text` are the original attention paths, `block` the diffusers block; `q_norm`/`k_norm`
    name the norms under each original path, `norm_params` their parameters."""
    a = f"{block}.attn"
    return [
        Entry(f"{image}.qkv", (f"{a}.to_q", f"{a}.to_k", f"{a}.to_v")),
        Entry(f"{text}.qkv", (f"{a}.add_q_proj", f"{a}.add_k_proj", f"{a}.add_v_proj")),
        Entry(f"{image}.{q_norm}", (f"{a}.norm_q",), params=norm_params),
        Entry(f"{image}.{k_norm}", (f"{a}.norm_k",), params=norm_params),
        Entry(f"{text}.{q_norm}", (f"{a}.norm_added_q",), params=norm_params),
        Entry(f"{text}.{k_norm}", (f"{a}.norm_added_k",), params=norm_params),
        Entry(f"{image}.proj", (f"{a}.to_out.0",)),
        Entry(f"{text}.proj", (f"{a}.to_add_out",)),
    ]


def keep_present(entries: Iterable[Entry], diffusers_keys: Iterable[str]) -> list[Entry]:
    """The entries whose every part exists in the model (candidate tables list every variant: qk norms,
    guidance input, dual attention, the last block's missing context outputs)."""
    keys = set(diffusers_keys)
    found = []
    for entry in entries:
        present = [any(Entry.part_name(part, d) in keys for _, d in entry.params) for part in entry.parts]
        if all(present):
            found.append(entry)
    return found


def _swap(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def to_original(state: Mapping[str, torch.Tensor], entries: Iterable[Entry], prefix: str = "") -> dict:
    """A diffusers state dict in the original layout (under `prefix`). Every key must be covered."""
    out, used = {}, set()
    for entry in entries:
        for original_suffix, suffix in entry.params:
            names = [Entry.part_name(part, suffix) for part in entry.parts]
            if not all(name in state for name in names):
                continue
            value = torch.cat([state[name] for name in names], dim=0) if len(names) > 1 else state[names[0]]
            out[prefix + entry.original_name(original_suffix)] = _swap(value) if entry.swap_halves else value
            used.update(names)
    left = sorted(set(state) - used)
    if left:
        raise ValueError(f"{len(left)} weights have no original-layout name (e.g. {', '.join(left[:3])}); "
                         "is a LoRA adapter still attached?")
    return out


def from_original(state: Mapping[str, torch.Tensor], entries: Iterable[Entry],
                  shapes: Mapping[str, torch.Size], prefix: str = "", source: str = "checkpoint") -> dict:
    """The inverse of `to_original`; `shapes` (the diffusers model's parameter shapes) say how to split
    fused tensors. Unknown original keys are an error naming them."""
    out, used = {}, set()
    for entry in entries:
        for original_suffix, suffix in entry.params:
            key = prefix + entry.original_name(original_suffix)
            names = [Entry.part_name(part, suffix) for part in entry.parts]
            if key not in state or not all(name in shapes for name in names):
                continue
            value = _swap(state[key]) if entry.swap_halves else state[key]
            sizes = [shapes[name][0] if len(shapes[name]) else 1 for name in names]
            if len(names) > 1:
                if value.shape[0] != sum(sizes):
                    raise ValueError(f"{source}: {key} has {value.shape[0]} rows, the model expects {sum(sizes)} "
                                     f"({' + '.join(map(str, sizes))}); the checkpoint does not fit the config")
                pieces = torch.split(value, sizes, dim=0)
            else:
                pieces = [value]
            out.update(zip(names, pieces))
            used.add(key)
    left = sorted(k for k in state if k.startswith(prefix) and k not in used)
    if left:
        raise ValueError(f"{source}: {len(left)} weights are not part of this model (e.g. {', '.join(left[:3])}); "
                         "the checkpoint does not fit the config")
    return out


# ------------------------------------------------------------------------------------------- LoRA

def lora_to_original(lora: Mapping[str, torch.Tensor], entries: Iterable[Entry], scale: float,
                     shapes: Mapping[str, torch.Size], prefix: str = "lora_unet_") -> dict:
    """peft LoRA weights (`<module>.lora_A.weight` / `.lora_B.weight`, one alpha/rank `scale` for all)
    in the kohya layout of the original modules: `<prefix><original path with _>.lora_down.weight`,
    `.lora_up.weight`, `.alpha`.

    A fused module's adapter is the adapters of its parts side by side: `lora_down` stacks their A
    matrices (rank = the sum of their ranks), `lora_up` places each B in its part's rows and rank
    columns (zero elsewhere), and alpha is scaled with the rank so that alpha / rank stays `scale`.
    Then up @ down * alpha / rank is, part by part, exactly the update each diffusers module gets.
    Parts without an adapter contribute zero rows (`shapes`, the model's parameter shapes, size them).
    """
    out, used = {}, set()
    for entry in entries:
        with_lora = [part for part in entry.parts if f"{part}.lora_A.weight" in lora]
        if not with_lora:
            continue
        downs = [lora[f"{part}.lora_A.weight"] for part in with_lora]
        ups = {part: lora[f"{part}.lora_B.weight"] for part in with_lora}
        rank = sum(d.shape[0] for d in downs)
        rows = [shapes[Entry.part_name(part, entry.params[0][1])][0] for part in entry.parts]
        up = downs[0].new_zeros(sum(rows), rank)
        row = column = 0
        for part, size in zip(entry.parts, rows):
            if part in ups:
                r = ups[part].shape[1]
                up[row:row + size, column:column + r] = ups[part]
                column += r
            row += size
        name = prefix + entry.original.replace(".", "_")
        out[f"{name}.lora_down.weight"] = torch.cat(downs, dim=0)
        out[f"{name}.lora_up.weight"] = _swap(up) if entry.swap_halves else up
        out[f"{name}.alpha"] = torch.tensor(float(scale * rank))
        used.update(f"{part}.lora_{kind}.weight" for part in with_lora for kind in "AB")
    left = sorted(set(lora) - used)
    if left:
        raise ValueError(f"{len(left)} LoRA weights have no original-layout module (e.g. {', '.join(left[:3])})")
    return out


def lora_from_original(kohya: Mapping[str, torch.Tensor], entries: Iterable[Entry],
                       shapes: Mapping[str, torch.Size], prefix: str = "lora_unet_") -> tuple[dict, dict]:
    """The inverse of `lora_to_original`: (peft LoRA weights, alpha/rank scale per module path).

    Block-diagonal fused adapters (as `lora_to_original` writes them) split back into their parts
    exactly; a fused adapter trained as one (a dense `lora_up`, as sd-scripts trains) gives every
    part the whole `lora_down` and its rows of `lora_up`, which applies the same update.
    """
    by_name = {prefix + entry.original.replace(".", "_"): entry for entry in entries}
    peft, scales = {}, {}
    for key in kohya:
        if not key.endswith(".lora_down.weight"):
            continue
        name = key.removesuffix(".lora_down.weight")
        if name not in by_name:
            raise ValueError(f"{name}: not a module of this model's original layout")
        entry = by_name[name]
        down, up = kohya[key], kohya[f"{name}.lora_up.weight"]
        up = _swap(up) if entry.swap_halves else up
        rank = down.shape[0]
        scale = float(kohya[f"{name}.alpha"]) / rank if f"{name}.alpha" in kohya else 1.0
        sizes = [shapes[Entry.part_name(part, entry.params[0][1])][0] for part in entry.parts]
        row_blocks = torch.split(up, sizes, dim=0)
        used = [i for i, block in enumerate(row_blocks) if block.abs().sum() > 0] or list(range(len(sizes)))
        diagonal = _is_block_diagonal(row_blocks, used, rank)
        for n, i in enumerate(used):
            part = entry.parts[i]
            if diagonal:
                own = slice(n * rank // len(used), (n + 1) * rank // len(used))
                peft[f"{part}.lora_A.weight"] = down[own].contiguous()
                peft[f"{part}.lora_B.weight"] = row_blocks[i][:, own].contiguous()
            else:
                peft[f"{part}.lora_A.weight"], peft[f"{part}.lora_B.weight"] = down, row_blocks[i].contiguous()
            scales[part] = scale  # B A * alpha / rank of the whole: the same update either way
    return peft, scales


def _is_block_diagonal(row_blocks, used: list[int], rank: int) -> bool:
    """Whether each used part's rows of `lora_up` touch only its own equal share of the rank columns."""
    if len(used) < 2 or rank % len(used):
        return False
    share = rank // len(used)
    for n, i in enumerate(used):
        outside = torch.cat([row_blocks[i][:, :n * share], row_blocks[i][:, (n + 1) * share:]], dim=1)
        if outside.abs().sum() > 0:
            return False
    return True
