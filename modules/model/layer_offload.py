"""Layer offload (block swap): a frozen base's blocks wait in host memory and come to the GPU just before they run.

A LoRA's base never changes, so most of its repeated blocks (`ModelFamily.repeated_blocks`: a transformer's
blocks, a UNet's ResNet and transformer blocks) need not stay on the GPU: their frozen weights live in one
page-locked host buffer, and each block's are copied to the GPU - one copy per block, on a side stream - while
the block before it computes. With activation checkpointing the backward recomputes each block, so the
weights come again for the backward, in reverse order. The trained weights (LoRA's adapters, DoRA's
magnitudes), buffers and everything outside the swapped blocks stay on the GPU; an fp8 base's float8 bytes
swap as they are (half the traffic of bf16). Under DDP the ranks of a machine hold one host copy together
(`shared_host_copy.py`): the first writes it, the others map it, each page-locks its mapping.

How a block's weights come and go: its frozen parameters are replaced by new `Parameter`s over a GPU copy
for the block's forward, and the host ones put back after. Autograd keeps the GPU ones it saved (so a
block that is not checkpointed keeps its weights until its backward, which is correct but saves nothing:
the plan turns checkpointing on with layer offload), and the caching allocator reuses a copy's memory only
once the compute stream is past it (`record_stream`). At most two swapped blocks are on the GPU at once by
this schedule: the one running and the one being copied (`most_loaded` records it for the tests).

Which blocks swap: `count` of them, spread evenly over the run order, so each copy has the compute of the
resident blocks between two swapped ones to hide behind. The run order is learned from the first forward
(a UNet's blocks run in another order than its module tree lists them); until then a wrong guess costs one
copy that waits.

Not with `training.compile` or CUDA graphs (the weights' addresses change every call) nor channels-last
(it would rewrite the host weights): validation refuses those; the memory plan chooses how many blocks swap.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch import nn

from modules.planning.memory_need import swapped_positions
from modules.model.shared_host_copy import MachineShare
from modules.util.host_memory import mapping_usage

log = logging.getLogger("tandem")

ALIGNMENT = 256
"""Bytes each weight's place in the host buffer is aligned to (any dtype's view of it is then valid)."""


@dataclass
class _Weight:
    module: nn.Module
    name: str
    host: nn.Parameter
    """The parameter itself, its data a view of the host buffer: put back after each use."""
    offset: int
    """Bytes from the start of its block's region."""
    nbytes: int
    place: torch.Tensor | None = None
    """Its place in the host buffer, as a tensor of its dtype and shape."""


@dataclass
class _Block:
    position: int
    """Its place in the family's list of repeated blocks."""
    module: nn.Module
    weights: list[_Weight]
    nbytes: int
    host: torch.Tensor | None = None
    """Its region of the host buffer (uint8)."""


class _Copy:
    """One block's weights on the device: issued (maybe still copying), then used by the compute stream."""

    def __init__(self, data: torch.Tensor, event) -> None:
        self.data = data
        self.event = event
        self.in_use = False


class LayerOffload:
    """The swapped blocks of one denoiser and the schedule that brings each to `device` ahead of its use."""

    def __init__(self, blocks: list[nn.Module], count: int, device: torch.device, record: bool = False,
                 share: MachineShare | None = None) -> None:
        """`blocks`: the family's repeated blocks (in any order: the run order is learned); `count`: how many
        swap; `record`: keep `trace` (what moved, in order) for tests; `share`: the ranks of this machine, which
        then hold one host copy together (`shared_host_copy.py`; every rank makes its `LayerOffload` at once)."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.blocks = [self._describe(position, blocks[position]) for position in swapped_positions(len(blocks), count)]
        self.blocks = [b for b in self.blocks if b.weights]
        self.by_module = {id(b.module): b for b in self.blocks}
        self._host_weights = {id(w.host) for b in self.blocks for w in b.weights}
        self.order = [b.position for b in self.blocks]
        """Swapped blocks in the order they run, learned from the first forward."""
        self._seen: list[int] = []
        self.loaded: dict[int, _Copy] = {}
        self.most_loaded = 0
        """The most swapped blocks the device held at once (issued or in use)."""
        self.trace: list[tuple[str, int]] | None = [] if record else None
        self.copied_bytes = 0
        self.sharing = 1
        """How many ranks of this machine hold the host copy together (1: it is this process's own)."""
        self._buffer = self._fill_host_buffer(share)
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._handles = [h for b in self.blocks for h in (
            b.module.register_forward_pre_hook(self._before), b.module.register_forward_hook(self._after))]

    # ---------------------------------------------------------------- set-up
    @staticmethod
    def _describe(position: int, module: nn.Module) -> _Block:
        weights, offset, seen = [], 0, set()
        for owner_name, owner in module.named_modules():
            for name, p in owner.named_parameters(recurse=False):
                if p.requires_grad or id(p) in seen:
                    continue  # trained weights stay on the device; a tied weight is moved once
                seen.add(id(p))
                nbytes = p.numel() * p.element_size()
                weights.append(_Weight(owner, name, p, offset, nbytes))
                offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
        return _Block(position, module, weights, offset)

    def _places(self, buffer: torch.Tensor):
        """(block, weight, its place in `buffer` as a tensor of its dtype and shape) for every swapped weight."""
        start = 0
        for block in self.blocks:
            region = buffer[start:start + block.nbytes]
            start += block.nbytes
            for w in block.weights:
                yield block, w, region, region[w.offset:w.offset + w.nbytes].view(w.host.dtype).view(w.host.shape)

    def _write(self, buffer: torch.Tensor) -> None:
        for _, w, _, place in self._places(buffer):
            place.copy_(w.host.data)

    def _fill_host_buffer(self, share: MachineShare | None) -> torch.Tensor:
        """Every swapped weight into one host buffer (page-locked on CUDA: copies from it run asynchronously),
        each parameter's data then a view of its place there; with `share`, the machine's one buffer."""
        total = sum(b.nbytes for b in self.blocks)
        if share is not None:
            buffer = share.buffer(total, self._write)
            self.sharing = share.sharing
        else:
            buffer = torch.empty(total, dtype=torch.uint8)
            self._write(buffer)
        for block, w, region, place in self._places(buffer):
            block.host, w.place = region, place
            w.host.data = place  # this process's own copy, loaded with the model, goes
        if self.cuda and total:
            # Each rank page-locks its own mapping of a shared buffer: the pages it locks are the same ones.
            status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), total, 0)
            if int(status) != 0:
                raise RuntimeError(f"layer offload: page-locking {total / 2**30:.1f} GiB of host memory failed "
                                   f"(cudaHostRegister error {int(status)}); free host memory or set "
                                   "multi_gpu.layer_offload to off")
        return buffer

    @contextlib.contextmanager
    def held_back(self):
        """Inside, the swapped weights are out of the modules' reach: `Module.to(device)` moves everything else."""
        weights = [w for b in self.blocks for w in b.weights]
        for w in weights:
            w.host.data = torch.empty(0, dtype=w.host.dtype)
        try:
            yield
        finally:
            for w in weights:
                w.host.data = w.place

    def close(self) -> None:
        """Remove the hooks and give the page-locked memory back (the weights stay in host memory)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for position in list(self.loaded):
            self._release(position)
        if self.cuda and self._buffer.numel():
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
        self._buffer = torch.empty(0, dtype=torch.uint8)

    @property
    def host_bytes(self) -> int:
        return self._buffer.numel()

    def host_usage(self) -> dict | None:
        """{"rss", "pss"}: bytes of the host copy this process has in memory, and its share of them (a shared
        copy's pages divided by the processes that map them); None where unknown (not Linux, nothing swapped)."""
        if not self._buffer.numel():
            return None
        return mapping_usage(self._buffer.data_ptr())

    def is_swapped(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is one of the swapped weights as it waits in host memory."""
        return id(tensor) in self._host_weights and any(tensor is w.host for b in self.blocks for w in b.weights)

    # ---------------------------------------------------------------- moving
    def _note(self, what: str, position: int) -> None:
        if self.trace is not None:
            self.trace.append((what, position))

    def _issue(self, position: int) -> None:
        """Start copying a block's weights to the device (on the side stream)."""
        block = self._block(position)
        if self.cuda:
            with torch.cuda.stream(self._stream):
                data = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)
                data.copy_(block.host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            data, event = block.host.clone(), None  # CPU processes: a real copy, so a stale weight would show
        self.loaded[position] = _Copy(data, event)
        self.most_loaded = max(self.most_loaded, len(self.loaded))
        self.copied_bytes += block.nbytes
        self._note("copy", position)

    def _use(self, position: int) -> None:
        """The block computes with the device copy from here (the compute stream waits for the copy)."""
        copy, block = self.loaded[position], self._block(position)
        if copy.in_use:
            return
        if copy.event is not None:
            torch.cuda.current_stream(self.device).wait_event(copy.event)
            copy.data.record_stream(torch.cuda.current_stream(self.device))
        for w in block.weights:
            view = copy.data[w.offset:w.offset + w.nbytes].view(w.host.dtype).view(w.host.shape)
            w.module._parameters[w.name] = nn.Parameter(view, requires_grad=False)
        copy.in_use = True
        self._note("use", position)

    def _release(self, position: int) -> None:
        """The host weights back in the block; the device copy is freed once nothing (autograd) holds it."""
        copy = self.loaded.pop(position)
        if copy.in_use:
            for w in self._block(position).weights:
                w.module._parameters[w.name] = w.host
        self._note("release", position)

    def _block(self, position: int) -> _Block:
        return next(b for b in self.blocks if b.position == position)

    # ---------------------------------------------------------------- the schedule
    @staticmethod
    def _in_backward() -> bool:
        """Whether autograd's engine is running a backward here (checkpointing's recompute of a block)."""
        return torch._C._current_graph_task_id() != -1

    def _learn(self, position: int, backward: bool) -> None:
        """Keep the order of the forward's calls; a complete pass becomes the order prefetching follows."""
        if backward or position in self._seen:
            if len(self._seen) == len(self.blocks):
                self.order = list(self._seen)
            self._seen = [] if backward else [position]
        else:
            self._seen.append(position)

    def _neighbour(self, position: int, backward: bool) -> int | None:
        at = self.order.index(position)
        at += -1 if backward else 1
        return self.order[at] if 0 <= at < len(self.order) else None

    def _before(self, module: nn.Module, args) -> None:
        position = self.by_module[id(module)].position
        backward = self._in_backward()
        self._learn(position, backward)
        following = self._neighbour(position, backward)
        # Nothing else stays: a block whose recompute stopped early (checkpointing stops once it has what the
        # backward needs) never reached its forward hook, and a copy the order's first guess prefetched wrongly.
        for other in [p for p in self.loaded if p not in (position, following)]:
            self._release(other)
        if position not in self.loaded:
            self._issue(position)  # not prefetched (the first call, or the order changed): this one waits
        self._use(position)
        if following is not None and following not in self.loaded:
            self._issue(following)  # copied while this block computes

    def _after(self, module: nn.Module, args, output) -> None:
        position = self.by_module[id(module)].position
        backward = self._in_backward()
        # The block the next pass needs first stays: the last one for the backward's recompute after a training
        # forward, the first one for the next step's forward after the backward.
        if backward and position == self.order[0]:
            return
        if not backward and torch.is_grad_enabled() and position == self.order[-1]:
            return
        if position in self.loaded:
            self._release(position)


def offload_blocks(bundle, count: int, device: torch.device, share: MachineShare | None = None) -> LayerOffload | None:
    """Swap `count` of the denoiser's repeated blocks (None: nothing swaps); logs what it moved. `share`: the ranks of
    this machine hold one host copy together (every rank calls this at once)."""
    blocks = bundle.family.repeated_blocks(bundle)
    if count <= 0 or not blocks:
        return None
    offload = LayerOffload(blocks, count, device, share=share)
    where = "page-locked host" if offload.cuda else "host"
    if offload.sharing > 1:
        where += f" memory shared by the {offload.sharing} processes of this machine (one copy"
    else:
        where += " memory (this process's copy"
    log.info("Layer offload (multi_gpu.layer_offload): %d of %d blocks of the %s wait in %s, %.2f GiB), copied to "
             "the GPU ahead of use.", len(offload.blocks), len(blocks), bundle.denoiser_name, where,
             offload.host_bytes / 2**30)
    return offload
