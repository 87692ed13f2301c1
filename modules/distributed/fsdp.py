"""Sharded training with PyTorch's FSDP2 (`fully_shard`): what `multi_gpu.strategy = fsdp` changes.

Each of the model family's repeated blocks (`family.repeated_blocks`; the layers of a text encoder that
trains) becomes one FSDP unit, and the trained module (`TrainingModel`) the root unit holding the rest.
Every rank then keeps 1/N of every parameter, gradient and optimizer state: a unit's parameters are
gathered just before it runs and freed after, and its gradients are reduce-scattered as soon as they
exist. Parameters become DTensors (`p.to_local()` is this rank's shard, `p.full_tensor()` gathers the
whole one - a collective every rank must join).

Precision: master weights, optimizer state and gradient reduction stay fp32; with `training.precision
= bf16` the gathered weights are bf16, so the forward and backward compute in bf16. Inputs are not cast
(`cast_forward_inputs=False`): timesteps and rotary embeddings keep fp32 and autocast decides per op,
as under DDP.

Gradient checkpointing: PyTorch's composable `checkpoint` on each block *before* it is sharded.
diffusers' own checkpointing inside a sharded block fails in the recompute on Flux ("Recomputed values
... have different metadata"), see shared/ANCHORS.md.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

RUN_PART = "run_part"
"""The trained module's method that runs one of its parts alone (`TrainingModel.run_part`), registered
with FSDP so that its hooks run around it as around a training forward."""


class FSDPUnavailable(RuntimeError):
    pass


def _api():
    try:
        from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                            fully_shard, register_fsdp_forward_method)
    except ImportError:
        raise FSDPUnavailable(
            f"multi_gpu.strategy fsdp needs PyTorch 2.6 or newer (FSDP2's fully_shard); this is {torch.__version__}. "
            "Update torch, or set multi_gpu.strategy to ddp.") from None
    return CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method


def mixed_precision(precision: str):
    """bf16 compute with fp32 master weights and fp32 gradient reduction; fp32 throughout for fp32."""
    MixedPrecisionPolicy = _api()[2]
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if precision == "fp32":
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    raise ValueError(f"training.precision {precision!r} with multi_gpu.strategy fsdp: use bf16 or fp32 (fp16 loss "
                     "scaling is not supported with sharded gradients), or set multi_gpu.strategy to ddp.")


def offload_policy(cpu_offload: bool, device: torch.device):
    """FSDP2's `CPUOffloadPolicy` with `multi_gpu.fsdp_cpu_offload`: the shards, their gradients and the
    optimizer step live in host memory (pinned, for a GPU's copies in and out). CPU processes run the same
    code with nothing to move, which is how the tests cover it. Without it, no offload."""
    CPUOffloadPolicy, OffloadPolicy = _api()[0], _api()[3]
    if cpu_offload:
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def shard(model: nn.Module, blocks: list[nn.Module], device: torch.device, precision: str, checkpointing: bool,
          cpu_offload: bool) -> nn.Module:
    """Shard `model` in place: each block a unit (checkpointed first when `checkpointing`), `model` the root.

    `model` may still be on the CPU: each unit's shard moves to `device` as it is sharded, so no GPU
    ever holds more than one whole block. Returns `model` (now also an `FSDPModule`).
    """
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed as dist

    fully_shard, register_method = _api()[4:]
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options = dict(mesh=mesh, mp_policy=mixed_precision(precision), offload_policy=offload_policy(cpu_offload, device))
    if checkpointing:
        from torch.distributed._composable import checkpoint
    for block in blocks:
        if checkpointing:
            checkpoint(block)
        fully_shard(block, **options)
    fully_shard(model, **options)
    register_method(model, RUN_PART)
    return model


@contextlib.contextmanager
def calls_through_root(root: nn.Module, parts: list[str], autocast=contextlib.nullcontext()):
    """Inside the block, a call of one of the root's parts (a diffusers pipeline calling the denoiser or a
    text encoder that trains) enters through the root, so FSDP gathers the root's own weights and then
    each block's, as in training. Every rank must make the same calls (each gather is collective).
    `autocast`: the training autocast, for weights gathered in bf16."""
    modules = [root.get_submodule(name) for name in parts]
    run = getattr(root, RUN_PART)
    for name, module in zip(parts, modules):
        module.forward = functools.partial(run, name)
    try:
        with autocast:
            yield
    finally:
        for module in modules:
            del module.forward


def gradient_sync(model: nn.Module, sync: bool):
    """Reduce-scatter gradients after this backward (`sync`), or keep accumulating them unsharded on every
    rank until the last micro-batch (FSDP's equivalent of DDP's `no_sync`)."""
    model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
