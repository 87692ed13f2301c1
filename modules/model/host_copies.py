"""Frozen modules that leave the GPU after the cache go back onto the host copy they were loaded from.

With the latents and the text cached, the VAE and the frozen text encoders wait in host memory
(`trainer/caching.offload_cached_encoders`) and come to the GPU only for samples. Moving a module to the CPU
copies every weight into freshly allocated pageable memory: for T5-XXL (9.5 GB) and the VAE, the 6.7 s of
the four-GPU Flux.1-size job's cache phase after its encoding on H200s (2026-11-28, the lines of
docs/perf/2026-11-28-h200x4.jsonl), and again after each sampling that used them. Their weights never
change, and every weight was read into host memory before it moved to the GPU (`loading.load_model`). So the
loader keeps those host tensors for the modules that will wait there (`keep_host_copies`), and
`move_to_host` points the module's parameters and buffers back at them and lets the GPU's copies go: no copy
at all. A module without a kept copy, or whose tensors no longer match it (another shape or dtype, a trained
weight), is copied as before.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

KEY = "host_copies"
"""`bundle.extra[KEY]`: module name -> (the module, its tensors by name in host memory)."""


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    found = {f"parameter {name}": p.data for name, p in module.named_parameters(remove_duplicate=False)}
    found.update({f"buffer {name}": b for name, b in module.named_buffers(remove_duplicate=False)})
    return found


def keep_host_copies(bundle, parts: Iterable[str]) -> None:
    """Remember the host tensors of the bundle's `parts` ("vae", "text_encoders") before it moves to a GPU."""
    parts = set(parts)
    wanted = ([bundle.vae] if "vae" in parts else []) + (list(bundle.text_encoders) if "text_encoders" in parts else [])
    kept = bundle.extra.setdefault(KEY, {})
    for name, module in bundle.modules().items():
        if any(module is w for w in wanted):
            tensors = _tensors(module)
            if all(t.device.type == "cpu" for t in tensors.values()):
                kept[name] = (module, tensors)


def _matches(module: nn.Module, kept: dict[str, torch.Tensor]) -> bool:
    now = _tensors(module)
    if now.keys() != kept.keys():
        return False
    if any(p.requires_grad for p in module.parameters()):
        return False  # trained weights change: the host copy would be stale
    # Parameters are pointed back in place (`.data`), as `Module.to` moves them, so ties and references hold.
    return all(t.shape == kept[name].shape and t.dtype == kept[name].dtype and
               torch._has_compatible_shallow_copy_type(t, kept[name]) for name, t in now.items())


def move_to_host(bundle, module: nn.Module) -> bool:
    """Put `module` in host memory: onto its kept host copy where there is one that matches (True), else by
    copying it there (False)."""
    entry = next((value for value in bundle.extra.get(KEY, {}).values() if value[0] is module), None)
    if entry is None or not _matches(module, entry[1]):
        module.to("cpu")
        return False
    tensors = entry[1]
    for name, parameter in module.named_parameters(remove_duplicate=False):
        parameter.data = tensors[f"parameter {name}"]
    for name, _ in list(module.named_buffers(remove_duplicate=False)):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._buffers[leaf] = tensors[f"buffer {name}"]
    return True


def move_home(bundle, module: nn.Module, home: torch.device) -> None:
    """Send `module` back to `home` after a sampling: onto its kept host copy when home is the CPU."""
    if home.type == "cpu":
        move_to_host(bundle, module)
    else:
        module.to(home)
