"""Snapshots of training state in host memory, taken without making the CPU wait for the GPU.

A backup must hold the state of one step while training goes on changing it. Copying GPU tensors to
pinned host memory with `non_blocking=True` on the current stream puts the copies in the GPU's queue:
every later kernel (the next optimizer step, an EMA swap) runs after them, so the snapshot is exact,
and the CPU goes on queuing work at once. Whoever reads the snapshot waits for `HostSnapshot.ready()`
first (a background writer does, not the training loop).

The first snapshot of a size grows PyTorch's pinned pool (a full SD1.5 fine-tune: 10 GB; later backups
reuse it). PyTorch's default pins each block with one cudaHostAlloc call: 7.7-8.5 s of the first
backup's pause on H100 hosts. `use_fast_pinning` has it page the memory in from 8 threads and register
it instead: 2.4-3.7 s (docs/MultiGPUTraining.md, "Only rank 0 writes"). Two other ways measured worse:
cloning on the GPU and copying to pageable host memory in the writer thread paused the loop 0.2 s, but
training stalled ~9 s per backup while the 10 GB pageable copy ran; copying those clones through two
64 MiB pinned buffers stalled training as long.
"""
from __future__ import annotations

import os
from typing import Any

import torch


class HostSnapshot:
    def __init__(self, value: Any, event: torch.cuda.Event | None) -> None:
        self._value = value
        self._event = event

    def ready(self) -> Any:
        """The copied value, once every copy has landed in host memory."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._value


def snapshot_to_host(value: Any) -> HostSnapshot:
    """A copy of `value` (tensors inside dicts, lists and tuples; other values as they are) in host memory."""
    on_gpu = []

    def copy(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            obj = obj.detach()
            if obj.is_cuda:
                host = torch.empty_like(obj, device="cpu", pin_memory=True)
                host.copy_(obj, non_blocking=True)
                on_gpu.append(host)
                return host
            return obj.clone()
        if isinstance(obj, dict):
            return type(obj)((k, copy(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(copy(v) for v in obj)
        return obj

    copied = copy(value)
    event = None
    if on_gpu:
        event = torch.cuda.Event()
        event.record()
    return HostSnapshot(copied, event)


def _pinned_pool_stats() -> dict:
    """PyTorch's statistics of its pinned host memory pool; empty before CUDA is in use, or where this
    PyTorch has none."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    try:
        return torch.cuda.host_memory_stats()
    except (RuntimeError, AttributeError):  # a PyTorch without the pinned pool's statistics
        return {}


def pinned_alloc_seconds() -> float:
    """Seconds this process has spent so far asking CUDA for pinned host memory (growing PyTorch's pinned
    pool; later snapshots of the same sizes reuse it). 0 before CUDA is in use."""
    return _pinned_pool_stats().get("host_alloc_time.total", 0) / 1e6


def pinned_pool_bytes() -> int:
    """Bytes of pinned host memory PyTorch's pool holds (in use and cached); 0 before CUDA is in use."""
    stats = _pinned_pool_stats()
    return int(stats.get("allocated_bytes.current", stats.get("reserved_bytes.current", 0)))


def release_pinned_pool() -> int:
    """Give the pinned pool's unused blocks back to the system; returns the bytes released.

    A full SD1.5 fine-tune's backups leave 10 GB pinned. Unpinning and freeing it happens somewhere: left to
    the process's exit it added 1.3-1.9 s between `done` and the exit (H100 hosts), so the
    backup writer does it once the last backup is written, while the run samples and saves."""
    before = pinned_pool_bytes()
    if before == 0:
        return 0
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is None:  # a PyTorch without the call: the exit frees it
        return 0
    empty()
    return before - pinned_pool_bytes()


FAST_PINNING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


EXPANDABLE_SEGMENTS = "expandable_segments:True"

_applied: list[str] = []
"""The allocator settings Tandem has set in this process, restated with each new one (a setting string
replaces the last)."""


def _apply_allocator_setting(setting: str, user_says: str) -> bool:
    """Add `setting` to the allocator's settings unless the user's PYTORCH_ALLOC_CONF (or the older
    PYTORCH_CUDA_ALLOC_CONF) mentions `user_says` - theirs wins - or this PyTorch has no setter."""
    own = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
              or getattr(torch.cuda.memory, "_set_allocator_settings", None))  # the older PyTorch's name
    if user_says in own or setter is None:
        return False
    if setting not in _applied:
        _applied.append(setting)
    setter(",".join(filter(None, (own, *_applied))))  # the user's other settings restated with ours
    return True


def use_fast_pinning() -> bool:
    """Have PyTorch's pinned pool grow through cudaHostRegister from 8 threads (see the module doc);
    False where the user's allocator settings already say how to pin, or this PyTorch has no setter.
    Affects pinned memory allocated afterwards."""
    return _apply_allocator_setting(FAST_PINNING, "pinned_")


def use_expandable_segments() -> bool:
    """Let the GPU allocator grow segments in place: layer offload allocates and frees a block's copy of
    every size at every step, and with fixed segments those holes added up to 9 GiB reserved but unusable
    (Flux.2-dev on an H200 held to 24 GiB ran out of memory before its first step, 2026-12-02). False where
    the user's allocator settings already choose, or this PyTorch has no setter. Affects later segments."""
    return _apply_allocator_setting(EXPANDABLE_SEGMENTS, "expandable_segments")
