"""Save dtypes of model outputs (the atomic writers live in modules/util/atomic.py)."""
from __future__ import annotations


import torch

SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_save_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`fp16`/`bf16`/`fp32` (as in `save.save_dtype`) or a torch dtype -> the torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype {dtype!r} is not one of {', '.join(SAVE_DTYPES)}")
    return SAVE_DTYPES[dtype]
