"""Memory layout (strides) of tensors that must match a parameter's (training.channels_last)."""
from __future__ import annotations

import torch


def in_layout_of(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` copied into a tensor with `param`'s memory layout (strides), on `param`'s device."""
    return torch.empty_strided(param.shape, param.stride(), dtype=value.dtype, device=param.device).copy_(value)
