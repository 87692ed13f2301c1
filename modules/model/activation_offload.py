"""Activation offloading: what the forward keeps for the backward waits in host memory instead of the GPU.

With gradient checkpointing every block keeps only its input until the backward recomputes it; for a
1024 px image of a 20 B transformer that is ~1.6 GB per sample on each GPU (60 blocks x 4,352 tokens x
3,072 channels in bf16), for 81 frames of Wan 2.1 14B at 640 px 13.8 GB (40 blocks x 33,600 tokens x
5,120 channels). Autograd's saved-tensor hooks hand each such tensor to `pack` as the forward saves it
(checkpointing saves a block's inputs through them too, before its own hooks take over inside the
block) and back through `unpack` when the backward needs it: here a copy in pinned host memory, made
and returned on the compute stream. That costs the copies' time (PCIe, both ways, each step) and saves
their GPU memory - the `activation offloading` step of the memory plan, for every parallelism: the
one-process and DDP parallelisms and FSDP open `hooks` in their `gradient_sync` context
(`multi_gpu.activation_offload`, with gradient checkpointing).

Parameters are never copied, nor the views of them the layers save (`weight.t()`): FSDP's gathered
weights are freed after the forward and gathered again for the backward anyway; layer offload's swapped
weights (`layer_offload.py`) reach autograd as `Parameter`s over their GPU copy, freed once the block is
past them; an fp8 base's float8 bits are its `Parameter`s and its scales small. Nor small tensors, whose
copies would cost more than they save. CPU processes (the tests) copy every saved tensor that is no
parameter, through the same code.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

log = logging.getLogger("tandem")

MIN_BYTES_ON_GPU = 1 << 20
"""Tensors smaller than this stay on the GPU."""


class ActivationOffload:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.min_bytes = MIN_BYTES_ON_GPU if self.cuda else 0
        self.offloaded_bytes = 0
        """What the last micro-batch's forward moved to host memory."""
        self.reported = False

    @contextlib.contextmanager
    def hooks(self):
        """The context for one micro-batch's forward and backward; the first says how much it moved."""
        self.offloaded_bytes = 0
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield
        if not self.reported:
            self.reported = True
            size = self.offloaded_bytes
            amount = f"{size / 2 ** 20:.1f} MiB" if size >= 2 ** 20 else f"{size / 2 ** 10:.1f} KiB"
            log.info("Activation offloading: %s of what a micro-batch's forward keeps for the backward waited in host "
                     "memory.", amount)

    def pack(self, tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        # A layer saves its weight as a view (`weight.t()`): a view of a parameter is a parameter too. Layer
        # offload's swapped weights are `Parameter`s over their GPU copy, so they stay where they are.
        weight = isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)
        if weight or size < self.min_bytes or tensor.device.type != self.device.type:
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=self.cuda)
        host.copy_(tensor, non_blocking=self.cuda)
        self.offloaded_bytes += size
        return tensor.device, host

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=self.cuda)
