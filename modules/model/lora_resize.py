"""Resizing a LoRA's rank, as kohya's `resize_lora.py` does: no base model needed, the file's own layout kept.

Each module's up @ down is replaced by its best approximation of the
new rank (SVD, singular values split evenly between the factors), and its alpha becomes alpha x new / old
rank, so alpha / rank - the scale the LoRA is applied with - stays. The new rank is fixed (`rank`), or the
smallest that keeps `energy` of each module's squared Frobenius norm (kohya's `dynamic_method sv_fro`;
`rank` then caps it). Layouts: kohya/LyCORIS (`<module>.lora_down.weight`, `.lora_up.weight`, `.alpha`)
and diffusers/peft (`<module>.lora_A.weight` / `.lora_B.weight`, the alphas in the header's adapter
config - its `rank_pattern` and `alpha_pattern` take the modules whose rank differs from the most common).
"""
from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .lora_tool_parts import (ADAPTER_METADATA, ALPHA, LayerEnergy, PlainModule, Progress, ToolError,
                              free_output, kept_energy, pick_device, read_plain_lora, steps)


@dataclass
class ResizeReport:
    output: Path
    layers: list[LayerEnergy] = field(default_factory=list)

    def line(self) -> str:
        kept = [layer.kept for layer in self.layers]
        ranks = sorted({layer.new_rank for layer in self.layers})
        rank = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        worst = min(self.layers, key=lambda layer: layer.kept)
        return (f"Resized {len(kept)} modules to rank {rank} into {self.output}; kept energy min {worst.kept:.3f} "
                f"({worst.module}), mean {sum(kept) / len(kept):.3f}")


def resize(lora: str | Path, output: str | Path, rank: int | None = None, energy: float | None = None,
           device: str | None = None, overwrite: bool = False, progress: Progress | None = None) -> ResizeReport:
    """Write `lora` at a lower rank to `output` (.safetensors): `rank`, or the smallest rank per module that
    keeps `energy` (0-1] of it, at most `rank`. Tensors keep their dtype; the header its keys, with the
    rank and alpha entries updated."""
    from modules.util.atomic import save_safetensors_atomically

    if rank is None and energy is None:
        raise ToolError("give the new rank (--rank) or the energy to keep (--energy)")
    if rank is not None and rank < 1:
        raise ToolError(f"--rank is {rank}; a LoRA's rank is at least 1")
    if energy is not None and not 0 < energy <= 1:
        raise ToolError(f"--energy is {energy}; give the share of each module to keep, above 0 and at most 1 (e.g. 0.9)")
    source = Path(lora).expanduser()
    if not source.is_file():
        raise ToolError(f"{source}: no such file; choose the LoRA's .safetensors file")
    out = free_output(output, overwrite, single_file=True)
    device = pick_device(device)
    tensors, metadata, modules = read_plain_lora(source, "resize")
    largest = max(tensors[m.down_key].shape[0] for m in modules)
    if rank is not None and energy is None and rank > largest:
        raise ToolError(f"--rank {rank} is larger than {source.name}'s rank {largest}; a resize lowers the rank: "
                        f"choose --rank {largest} or less")
    report = ResizeReport(out)
    with torch.no_grad():
        for module in steps(modules, "resizing", progress):
            report.layers.append(_resize_module(module, tensors, rank, energy, device))
    new_alphas = {m.name: m.alpha * layer.new_rank / layer.old_rank for m, layer in zip(modules, report.layers)}
    for m in modules:
        if m.name + ALPHA in tensors:
            tensors[m.name + ALPHA] = torch.tensor(new_alphas[m.name], dtype=tensors[m.name + ALPHA].dtype)
    header = _header(metadata, modules, report.layers, new_alphas)
    save_safetensors_atomically(tensors, out, header)
    return report


def _resize_module(module: PlainModule, tensors: dict, rank: int | None, energy: float | None,
                   device: str) -> LayerEnergy:
    down, up = tensors[module.down_key], tensors[module.up_key]
    old = down.shape[0]
    # up @ down has rank <= old: the SVD of the small old x old core is the product's (QR of each factor).
    q_up, r_up = torch.linalg.qr(up.to(device, torch.float32).flatten(1))
    q_down, r_down = torch.linalg.qr(down.to(device, torch.float32).flatten(1).T)
    u, s, vh = torch.linalg.svd(r_up @ r_down.T)
    new = min(old, rank) if energy is None else _rank_for(s, energy, rank or old)
    new = min(new, old)
    root = s[:new].sqrt()
    new_up = (q_up @ u[:, :new]) * root
    new_down = root[:, None] * (vh[:new] @ q_down.T)
    tensors[module.up_key] = new_up.reshape(up.shape[0], new, *up.shape[2:]).to("cpu", up.dtype).contiguous()
    tensors[module.down_key] = new_down.reshape(new, *down.shape[1:]).to("cpu", down.dtype).contiguous()
    return LayerEnergy(module.name, old, new, kept_energy(s, new))


def _rank_for(singular: torch.Tensor, energy: float, most: int) -> int:
    """The smallest rank whose singular values hold `energy` of the squared total, at most `most`, at least 1."""
    shares = singular.double().square().cumsum(0)
    if float(shares[-1]) == 0:
        return 1
    shares = shares / shares[-1]
    return max(1, min(most, int((shares < energy - 1e-9).sum()) + 1))


def _header(metadata: dict, modules: list[PlainModule], layers: list[LayerEnergy], alphas: dict) -> dict[str, str]:
    header = dict(metadata)
    ranks = [layer.new_rank for layer in layers]
    common = collections.Counter(ranks).most_common(1)[0][0]
    if "ss_network_dim" in header:
        header["ss_network_dim"] = str(common) if len(set(ranks)) == 1 else "Dynamic"
    if "ss_network_alpha" in header:
        alpha_values = sorted(set(alphas.values()))
        header["ss_network_alpha"] = str(alpha_values[0]) if len(alpha_values) == 1 else "Dynamic"
    if ADAPTER_METADATA in header:
        configs = json.loads(header[ADAPTER_METADATA])
        by_component: dict[str, list[tuple[str, int, float]]] = {}
        for m, layer in zip(modules, layers):
            component, _, module = m.name.partition(".")
            base = module.removesuffix(".lora").removesuffix(".lora_linear_layer")
            by_component.setdefault(component, []).append((base, layer.new_rank, alphas[m.name]))
        for component, entries in by_component.items():
            r = collections.Counter(rank for _, rank, _ in entries).most_common(1)[0][0]
            alpha = collections.Counter(a for _, _, a in entries).most_common(1)[0][0]
            configs[f"{component}.r"] = r
            configs[f"{component}.lora_alpha"] = alpha
            configs[f"{component}.rank_pattern"] = {name: rank for name, rank, _ in entries if rank != r}
            configs[f"{component}.alpha_pattern"] = {name: a for name, _, a in entries if a != alpha}
        header[ADAPTER_METADATA] = json.dumps(configs, indent=2, sort_keys=True)
    header["tandem_resized_ranks"] = json.dumps(sorted(set(ranks)))
    return header
