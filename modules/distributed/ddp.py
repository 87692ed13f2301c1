"""Data parallelism with DistributedDataParallel: every process holds the whole model (`multi_gpu.strategy = ddp`).

DDP wraps exactly the trained module (`TrainingModel`), so gradients of every trained part are
all-reduced together, in buckets that overlap the backward, and frozen parts never enter the
all-reduce. Everything else - placement, backups, saving a model - is the whole-model behaviour of
`Parallelism`: rank 0 holds every weight and writes.
"""
from __future__ import annotations

import contextlib
import inspect
import logging

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from modules.launch.layout import ParallelLayout
from modules.trainer.parallelism import Parallelism, prepare_allocator_for_layer_offload
from modules.util import dist_utils as du

log = logging.getLogger("tandem")


def register_compression(ddp: DDP, mode: str) -> None:
    if mode == "none":
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    hooks = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
    if mode not in hooks:
        raise ValueError(f"multi_gpu.gradient_compression: unknown mode {mode!r}; use none, bf16 or fp16")
    ddp.register_comm_hook(None, hooks[mode])


def _no_buffer_sync_per_forward() -> dict:
    """Frozen buffers never change, so re-sending them every forward is wasted time (the name changed in torch 2.13)."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class DDPParallelism(Parallelism):
    name = "ddp"

    def __init__(self, multi_gpu, device: torch.device, layout: ParallelLayout, layer_offload_blocks: int = 0) -> None:
        """`multi_gpu`: the run's `MultiGPUConfig` (bucket size, graph and compression settings); `layout`: the
        run's, weights whole on every process; `layer_offload_blocks`: how many blocks every rank swaps
        (`Parallelism.place`), from one host copy per machine."""
        if layout.shard != 1:
            raise ValueError(f"multi_gpu.strategy ddp keeps the whole model on every process: a layout of "
                             f"{layout.describe()} with shard {layout.shard}")
        self.settings = multi_gpu
        self.device = device
        self.layout = layout
        self.layer_offload_blocks = layer_offload_blocks
        prepare_allocator_for_layer_offload(layer_offload_blocks)

    @classmethod
    def for_run(cls, cfg, device: torch.device, mesh, plan) -> DDPParallelism:
        """The parallelism of a run of `cfg` (as its memory plan `plan` set it, None: as configured); DDP uses the
        default process group, not the mesh."""
        from modules.trainer.one_gpu_plan import layer_offload_blocks
        return cls(cfg.multi_gpu, device, mesh.layout, layer_offload_blocks(cfg))

    def compile_splits_at_buckets(self, trainable: list[torch.nn.Parameter]) -> bool:
        """Split the compiled denoiser at DDP's buckets only where there is an all-reduce worth overlapping.

        The split lets each bucket's all-reduce run during the rest of the backward, but its graphs miss
        PyTorch's compile cache for autograd: every start traces the backward again. On 2 H100s a warm compile
        of the SD1.5 UNet (LoRA) took 52-57 s split against 17 s as one graph, and the one graph was not slower
        per step (docs/Performance.md, "`training.compile`"). Gradients in one or two buckets (a LoRA's) leave
        little to overlap; a full fine-tune's gigabytes keep the split."""
        gradient_bytes = sum(p.numel() * p.element_size() for p in trainable)
        split = gradient_bytes > 2 * self.settings.bucket_cap_mb * 2 ** 20
        log.info("training.compile: %s (%.0f MiB of gradients, multi_gpu.bucket_cap_mb %d).",
                 "one graph per DDP gradient bucket, so their all-reduces overlap the backward" if split else
                 "the denoiser compiles as one graph; its gradients are all-reduced after the backward",
                 gradient_bytes / 2 ** 20, self.settings.bucket_cap_mb)
        return split

    def wrap(self, model: torch.nn.Module, trainable: list[torch.nn.Parameter]):
        m = self.settings
        # Randomly initialised LoRA weights differ per rank unless rank 0's are copied everywhere.
        du.broadcast_parameters(model)
        if self.offload is not None:
            # The swapped frozen weights wait in host memory, loaded alike on every rank: DDP neither checks nor
            # broadcasts them (it takes one device per module).
            DDP._set_params_and_buffers_to_ignore_for_model(model, [
                name for name, p in model.named_parameters() if self.offload.is_swapped(p)])
        ddp = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                  bucket_cap_mb=m.bucket_cap_mb, find_unused_parameters=m.find_unused_parameters,
                  static_graph=m.static_graph, gradient_as_bucket_view=m.gradient_as_bucket_view,
                  **_no_buffer_sync_per_forward())
        register_compression(ddp, m.gradient_compression)
        return ddp, trainable

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module

    def gradient_sync(self, model: torch.nn.Module, last_micro_batch: bool):
        """All micro-batches but the last run inside `no_sync`: their gradients add up on each rank, and the
        last backward all-reduces the sum once; with activation offloading inside its hooks."""
        return self.with_offloaded_activations(contextlib.nullcontext() if last_micro_batch else model.no_sync())
