"""Snapshots of training state for a background writer, taken without making the CPU wait for the GPU.

A backup must hold the state of one step while training goes on changing it. Two ways, both queued on
the current stream, so every later kernel (the next optimizer step, an EMA swap) runs after the copies,
the snapshot is exact, and the CPU goes on queuing work at once:

- **staged on the GPU** (`SnapshotPlan` decides; when the GPU has room at training's peak): the tensors
  are cloned on the GPU, which takes milliseconds, and the writer thread moves the clones to host memory on
  a stream of its own, then frees them. Pinned host memory of a full fine-tune's size (10 GB for SD1.5's
  weights and Adam state) took 8 s to allocate on H100 hosts (session 12), the whole first backup's pause.
- **straight to pinned host memory**: non-blocking copies into PyTorch's pinned pool (allocated at the
  first backup, reused by later ones).

Whoever reads the snapshot calls `HostSnapshot.ready()` first (the background writer does, not the loop).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

GIB = 1024 ** 3


class HostSnapshot:
    def __init__(self, value: Any, event: torch.cuda.Event | None, staged_on: torch.device | None = None) -> None:
        self._value = value
        self._event = event
        self._staged_on = staged_on

    def ready(self) -> Any:
        """The copied value in host memory, once every copy has landed there."""
        if self._staged_on is not None:
            stream = torch.cuda.Stream(self._staged_on)
            stream.wait_event(self._event)  # the clones are complete
            with torch.cuda.stream(stream):  # off the training stream: the copies overlap the next steps
                # Blocking copies: the clones are only let go of (back to the allocator, which the training
                # stream reuses) once they are on the host.
                self._value = _map_tensors(self._value, lambda t: t.to("cpu") if t.is_cuda else t)
            self._staged_on = self._event = None
        elif self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._value


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _gpu_device(value: Any) -> torch.device | None:
    devices = set()
    _map_tensors(value, lambda t: devices.add(t.device) if t.is_cuda else None)
    return devices.pop() if len(devices) == 1 else None


def snapshot_to_host(value: Any, stage_on_gpu: bool = False) -> HostSnapshot:
    """A copy of `value` (tensors inside dicts, lists and tuples; other values as they are) for the host.

    `stage_on_gpu`: clone the GPU tensors on the GPU now and move them to the host in `ready()` (see the
    module's docstring); only where all of them are on one GPU."""
    device = _gpu_device(value) if stage_on_gpu else None
    if device is not None:
        staged = _map_tensors(value, lambda t: t.detach().clone())
        event = torch.cuda.Event()
        event.record()
        return HostSnapshot(staged, event, staged_on=device)
    on_gpu = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if not t.is_cuda:
            return t.clone()
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        on_gpu.append(host)
        return host

    copied = _map_tensors(value, copy)
    event = None
    if on_gpu:
        event = torch.cuda.Event()
        event.record()
    return HostSnapshot(copied, event)


def gpu_bytes(value: Any) -> int:
    """Bytes of the GPU tensors in `value`."""
    total = [0]
    _map_tensors(value, lambda t: total.__setitem__(0, total[0] + t.numel() * t.element_size()) if t.is_cuda else None)
    return total[0]


class SnapshotPlan:
    """Whether backups are staged on the GPU: decided at the first backup, from the room left on the GPU at
    training's peak so far, and kept for the run (a snapshot's size does not change; its clones are
    reused from PyTorch's cache by later backups)."""

    def __init__(self) -> None:
        self.stage_on_gpu: bool | None = None
        self.reason = ""

    def decide(self, snapshot_bytes: int, device: torch.device) -> bool:
        if self.stage_on_gpu is None:
            self.stage_on_gpu, self.reason = stage_on_gpu(snapshot_bytes, device)
        return self.stage_on_gpu


def stage_on_gpu(snapshot_bytes: int, device: torch.device) -> tuple[bool, str]:
    """(whether a snapshot of `snapshot_bytes` fits on `device` beside training's peak, why)."""
    if device.type != "cuda" or snapshot_bytes == 0:
        return False, "no GPU tensors"
    free, total = torch.cuda.mem_get_info(device)
    # Room at the peak: what the driver has free, plus what PyTorch holds in its cache now but needed at
    # training's peak so far (other processes on the GPU are counted by the driver).
    room = free + torch.cuda.memory_reserved(device) - torch.cuda.max_memory_reserved(device)
    margin = max(2 * GIB, total // 10)  # later batches of other shapes, a sampling's decoder, fragmentation
    fits = room >= snapshot_bytes + margin
    return fits, (f"{snapshot_bytes / GIB:.1f} GiB {'fits' if fits else 'does not fit'} in the "
                  f"{room / GIB:.1f} GiB free at training's peak (keeping {margin / GIB:.1f} GiB spare)")


def pinned_alloc_seconds() -> float:
    """Seconds this process has spent so far asking CUDA for pinned host memory (growing PyTorch's pinned
    pool; later snapshots of the same sizes reuse it). 0 before CUDA is in use."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0.0
    try:
        return torch.cuda.host_memory_stats().get("host_alloc_time.total", 0) / 1e6
    except (RuntimeError, AttributeError):  # a PyTorch without the pinned pool's statistics
        return 0.0
