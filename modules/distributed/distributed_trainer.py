"""The multi-process trainer: the same loop as `GenericTrainer`, with DDP around the trained module.

What changes with N processes, and nothing else, lives here: joining the process group, identical
initial weights on every rank, the DistributedDataParallel wrapper (with its bucket, graph and
compression settings) and skipping the gradient all-reduce on all micro-batches but the last.
The sampler, rank-0-only writing, LR scaling and the loss/command exchange use the rank/world helpers
in `dist_utils`, which the base loop already calls.
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import logging

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from modules.util import dist_utils as du
from modules.distributed.process_group import destroy, init_worker
from modules.trainer.base_trainer import BaseTrainer

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


class DistributedTrainer(BaseTrainer):
    def __init__(self, cfg, callbacks=None, inbox=None, device_type: str = "cuda", resume: str | None = None,
                 run_id: str | None = None) -> None:
        super().__init__(cfg, callbacks, inbox, resume, run_id)
        self.device_type = device_type

    def setup_environment(self) -> None:
        self.device = init_worker(self.cfg.multi_gpu.backend, self.device_type, self.cfg.multi_gpu.timeout_minutes)
        self.configure_backends()

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        m = self.cfg.multi_gpu
        # Randomly initialised LoRA weights differ per rank unless rank 0's are copied everywhere.
        du.broadcast_parameters(model)
        ddp = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                  bucket_cap_mb=m.bucket_cap_mb, find_unused_parameters=m.find_unused_parameters,
                  static_graph=m.static_graph, gradient_as_bucket_view=m.gradient_as_bucket_view,
                  **_no_buffer_sync_per_forward())
        register_compression(ddp, m.gradient_compression)
        return ddp

    def gradient_sync(self, last_micro_batch: bool):
        return contextlib.nullcontext() if last_micro_batch else self.model.no_sync()

    def teardown(self) -> None:
        # DDP holds the process group, and the trainer's reference cycles kept it alive until interpreter
        # exit, where freeing gloo's group has aborted finished workers ("terminate called without an
        # active exception", pytorch/pytorch#179291). Free it now, while everything it needs is alive.
        self.model = None
        gc.collect()
        destroy()
