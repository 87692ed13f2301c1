"""The names of weight dtypes used in configs (`fp32`, `bf16`, `fp16`) and their torch dtypes.

One table for loading (frozen parts), saving and the trainer; the atomic writers live in
modules/util/atomic.py.
"""
from __future__ import annotations

import torch

SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def resolve_save_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`fp16`/`bf16`/`fp32` (as in `save.save_dtype`; torch's names too) or a torch dtype -> the torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _ALIASES.get(dtype, dtype)
    if name not in SAVE_DTYPES:
        raise ValueError(f"save dtype {dtype!r} is not one of {', '.join(SAVE_DTYPES)}")
    return SAVE_DTYPES[name]


def as_dtype(module, dtype: torch.dtype):
    """`module` in `dtype`; casting frees each old tensor as it goes, and a no-op cast is skipped
    (which also skips diffusers' warning). Here, below both, so the families' loaders and `loading.py`,
    which picks a family, need not import each other."""
    return module if next(module.parameters()).dtype == dtype else module.to(dtype)
