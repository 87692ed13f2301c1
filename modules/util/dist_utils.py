"""Every torch.distributed helper the rest of the code uses.

Each helper is a no-op (or the obvious single-process answer) when no process group exists, so the
training loop calls them unconditionally and the single-GPU path is the multi-GPU path with N = 1.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", rank())) if is_distributed() else 0


def local_world_size() -> int:
    """Processes of this machine (several machines: fewer than `world_size`)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size())) if is_distributed() else 1


GPU_NUMBER = "TANDEM_GPU_NUMBER"
"""This worker's GPU among those its launch could see, once the worker sees only its own GPU as `cuda:0`
(process_group.see_only_own_gpu)."""


def gpu_number(device: torch.device) -> int:
    """The number of GPU `device` among the GPUs the launch could see (what messages call `GPU n`)."""
    return int(os.environ.get(GPU_NUMBER, device.index or 0))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (e.g. builds a shared file); the others run it after, reusing it."""
    if not is_main():
        barrier()
    try:
        yield
    finally:
        if is_main():
            barrier()


T = TypeVar("T")


class MainRankFailed(RuntimeError):
    """Raised on the other ranks when something only rank 0 does (writing a file) failed there."""


def on_main(work: Callable[[], T]) -> T | None:
    """Run `work` on rank 0 only, then tell every rank how it went.

    Every rank returns together: rank 0 with `work`'s result, the others with None; if `work` raised on
    rank 0, rank 0 re-raises it and every other rank raises `MainRankFailed` naming it. So no rank ever
    waits at a barrier for a rank 0 that took an error path (a failed save used to hang the other ranks
    until the process-group timeout), and every rank can take the same recovery path together.
    """
    return _run_and_share(work, is_main(), lambda failure: [(0, broadcast_object(failure))])


def on_every_rank(work: Callable[[], T]) -> T:
    """Run `work` on every rank (work that holds collectives: gathering a sharded model to save it), then
    tell every rank how it went, as `on_main` does: if it raised anywhere, every rank raises (the rank
    that failed its own error, the others `MainRankFailed` naming the first rank that failed)."""
    return _run_and_share(work, True, lambda failure: list(enumerate(all_gather_objects(failure))))


def _run_and_share(work: Callable[[], T], runs_here: bool,
                   share: Callable[[str | None], list[tuple[int, str | None]]]) -> T | None:
    """Run `work` where `runs_here`, then `share` this rank's failure (None if none) and get (rank, failure)
    of the ranks that ran it; raise this rank's own error, or `MainRankFailed` naming the first that failed."""
    result, error = None, None
    if runs_here:
        try:
            result = work()
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
            error = e
    if is_distributed():
        failures = share(None if error is None else f"{type(error).__name__}: {error}")
        first = next(((rank, failure) for rank, failure in failures if failure is not None), None)
        if first is not None and error is None:
            raise MainRankFailed(f"rank {first[0]} failed: {first[1]}")
    if error is not None:
        raise error
    return result


def _comm_device() -> torch.device:
    # NCCL only moves CUDA tensors; gloo only CPU ones. With both ("cuda:nccl,cpu:gloo", for FSDP's CPU
    # offload) the GPU keeps carrying the loop's own collectives.
    if is_distributed() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum_tensor(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks without a host sync on NCCL (the GPU stream waits, the CPU does not).

    Returns the summed tensor, which lives on the communication device (the CPU for gloo)."""
    if not is_distributed():
        return t
    t = t.to(_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_comm_device())
    return box[0]


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` on every rank (list indexed by rank)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (list indexed by rank); None on the other ranks."""
    if not is_distributed():
        return [obj]
    out = [None] * world_size() if is_main() else None
    dist.gather_object(obj, out, dst=0)
    return out


@torch.no_grad()
def broadcast_parameters(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank hold rank `src`'s trainable weights (randomly initialised LoRA weights differ otherwise)."""
    if not is_distributed():
        return
    device = _comm_device()
    for p in module.parameters():
        if not p.requires_grad:
            continue
        buf = p.data.to(device)
        dist.broadcast(buf, src=src)
        if buf.data_ptr() != p.data.data_ptr():
            p.data.copy_(buf)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (FSDP's DTensor parameters), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element is a finite number - over every rank's shard when the tensors are sharded,
    so that all ranks give the same answer."""
    parts = [local_part(t.detach()) for t in tensors]
    finite = torch.stack([torch.isfinite(p).all() for p in parts]).all()
    if is_distributed() and any(hasattr(t, "to_local") for t in tensors):
        bad = all_reduce_sum_tensor((~finite).to(torch.float32).reshape(1))
        return bool(bad.item() == 0)
    return bool(finite)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a whole tensor (read from a file on every rank) into a possibly sharded parameter or state,
    keeping only this rank's part - no communication."""
    with torch.no_grad():
        if hasattr(param, "device_mesh"):  # an FSDP (DTensor) parameter
            from torch.distributed.tensor import distribute_tensor
            part = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(part.to_local())
        else:
            param.copy_(full.to(param.dtype))
