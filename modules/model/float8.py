"""Frozen Linear weights stored in float8 and computed in bf16: a LoRA base in half of bf16's memory.

`model.unet_dtype = fp8` replaces every `nn.Linear` of the denoiser by a `Float8Linear` whose weight is
PyTorch's own `float8_e4m3fn` (4 exponent bits, 3 mantissa bits, largest value 448) with one scale per
tensor, and whose forward turns it back into the compute dtype (bf16 under autocast) one layer at a time.
A 12 B Flux transformer, whose weights are nearly all Linear, then holds about 12 GB instead of 24;
convolutions, norms, embeddings and biases stay in bf16.

Choices, and why:
- **The scale is a power of two** (`2^k`, the smallest with `max|w| / 2^k <= 448`), not `max|w| / 448`.
  Multiplying a float8 value by a power of two is exact in bf16, so the weights computed with are exactly
  the stored ones, on every device; an arbitrary scale would round every weight once more. The range used
  is at worst half of float8's, which costs nothing in precision (floating point: the relative step is
  the same at every magnitude) and only moves the smallest weights one binade closer to float8's
  subnormals.
- **The bits live in a `uint8` tensor** (viewed as `float8_e4m3fn` to compute). Float types are cast by
  `module.to(dtype)`, by peft (which casts new adapters to the dtype of the layer's weight) and are not
  reduced by every collective; a `uint8` tensor is left alone by all of them, and DDP broadcasts it at
  start-up on gloo and NCCL alike.
- **The backward recomputes the bf16 weight from the float8 one** (`_Float8Linear`): autograd would
  otherwise keep each layer's bf16 weight until the backward, which is all of bf16's memory again.

Only the frozen base is stored so: LoRA's adapters stay fp32 and train as with any other base, and the
LoRA files are the same. Full fine-tunes train every weight and are refused (validation). Under FSDP the
bits become a float8 parameter just before sharding (`shardable`), each rank holding a shard of them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max  # 448


def power_of_two_scale(weight: torch.Tensor) -> float:
    """The smallest power of two `s` with `max|weight| / s <= 448` (1 for an all-zero tensor)."""
    largest = float(weight.detach().abs().max()) if weight.numel() else 0.0
    if not math.isfinite(largest):
        raise ValueError("holds NaN or infinite values")
    if largest == 0.0:
        return 1.0
    exponent = math.ceil(math.log2(largest / FLOAT8_MAX))
    while largest / 2.0 ** exponent > FLOAT8_MAX:  # log2's rounding at an exact power of two
        exponent += 1
    return 2.0 ** exponent


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(the float8 bits of `weight / scale` as uint8, scale)."""
    scale = power_of_two_scale(weight)
    bits = (weight.detach() / scale).to(FLOAT8).view(torch.uint8)  # dividing by 2^k is exact
    return bits, scale


def dequantize(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weights in `dtype`: float8 -> `dtype` is exact for bf16/fp16/fp32, and so is x 2^k. `bits` is the
    stored uint8, its float8 view, or - gathered by FSDP, which casts to the compute dtype - those values
    in bf16 already."""
    values = bits.view(FLOAT8) if bits.dtype == torch.uint8 else bits
    return values.to(dtype) * scale.to(dtype)


def shardable(module: nn.Module) -> int:
    """Hand every `Float8Linear` weight of `module` to FSDP2 as a float8 parameter (a view of the same bytes);
    returns how many. FSDP2 shards it like any weight (one byte per element on each rank) and casts each
    gathered block to its compute dtype, bf16 - exactly the float8 values - so the forward computes what it
    computes unsharded, and the all-gather moves bf16 as for a bf16 base. (Kept as uint8 it would be cast
    to bf16 as a number by FSDP versions that cast every parameter, and refused by those that cannot shard
    a parameter that is not floating point.)"""
    layers = float8_layers(module)
    for layer in layers:
        if layer.weight.dtype == torch.uint8:
            layer.weight = nn.Parameter(layer.weight.data.view(FLOAT8), requires_grad=False)
    return len(layers)


class _Float8Linear(torch.autograd.Function):
    """`x @ W.T + b` with `W` dequantized for the forward and again for the backward, never kept."""

    @staticmethod
    def forward(ctx, x, bits, scale, bias, dtype):
        ctx.save_for_backward(bits, scale)
        ctx.compute_dtype, ctx.input_dtype = dtype, x.dtype
        return F.linear(x.to(dtype), dequantize(bits, scale, dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad_output):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        bits, scale = ctx.saved_tensors
        weight = dequantize(bits, scale, ctx.compute_dtype)
        grad_input = grad_output.to(ctx.compute_dtype).matmul(weight)
        return grad_input.to(ctx.input_dtype), None, None, None, None


class Float8Linear(nn.Linear):
    """A frozen `nn.Linear` whose weight is stored in float8 (see the module docstring).

    Still an `nn.Linear` (same `in_features`, `out_features`, `weight` shape, `bias`), so peft wraps it
    with a LoRA layer like any other; `weight` holds the float8 bits as uint8 and `weight_scale` the
    power-of-two scale. The forward computes in the autocast dtype (bf16 in training), or in the input's
    dtype without autocast.
    """

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a full-precision weight first
        if linear.weight.requires_grad or (linear.bias is not None and linear.bias.requires_grad):
            raise ValueError("only frozen layers can be stored in float8 (the weights of a LoRA base)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bits, scale = quantize(linear.weight)
        self.weight = nn.Parameter(bits, requires_grad=False)
        self.register_buffer("weight_scale", torch.tensor(scale, dtype=torch.float32, device=bits.device))
        self.bias = linear.bias

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        return _Float8Linear.apply(x, self.weight, self.weight_scale, self.bias, dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight float8_e4m3fn x {float(self.weight_scale):g}"


def store_linear_weights_in_float8(module: nn.Module, name: str = "the denoiser") -> int:
    """Replace every `nn.Linear` inside `module` by a `Float8Linear`; returns how many were replaced.

    Each layer's full-precision weight is freed as soon as its float8 copy exists, so the peak is the
    model in its loaded dtype plus one layer. Only the layers' names are listed up front: a list of the
    modules themselves would keep every replaced layer (and its weight) alive until the end."""
    paths = [path for path, child in module.named_modules()
             if path and isinstance(child, nn.Linear) and not isinstance(child, Float8Linear)]
    for path in paths:
        parent_name, _, child_name = path.rpartition(".")
        parent = module.get_submodule(parent_name)
        try:
            setattr(parent, child_name, Float8Linear(getattr(parent, child_name)))
        except ValueError as error:
            raise ValueError(f"{name}'s layer {path} cannot be stored in float8: {error}") from None
    return len(paths)


def float8_layers(module: nn.Module) -> list[Float8Linear]:
    return [m for m in module.modules() if isinstance(m, Float8Linear)]
