"""Process-group set-up and tear-down for one worker process."""
from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from modules.distributed.rendezvous import connect
from modules.distributed.worker_environment import store_environment, threads_per_worker
from modules.launch.backends import resolve_backend
from modules.util.dist_utils import GPU_NUMBER

log = logging.getLogger("tandem")


def share_cpu_threads(local_world: int) -> None:
    """Use this worker's share of the cores, unless OMP_NUM_THREADS says otherwise."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_worker(local_world))


def with_cpu_collectives(backend: str, cpu_collectives: bool) -> str:
    """The process group's backend string: NCCL moves GPU tensors only, so when collectives must also run
    on tensors in host memory (FSDP's CPU offload keeps the shards and their gradients there: gradient
    clipping's norm and the finite-weights check reduce over them) gloo serves the CPU beside it."""
    if cpu_collectives and backend == "nccl":
        return "cuda:nccl,cpu:gloo"
    return backend


def see_only_own_gpu(local_rank: int) -> bool:
    """Make this process see only its GPU, as `cuda:0`, before CUDA starts; False where CUDA already runs.

    torch.compile's cache keys name the GPU (the UNet's graph builds its timestep embedding on `cuda:N`), so
    with every rank on its own index, a cache filled by 1- and 2-GPU runs left ranks 2 and 3 of the next
    4-GPU run compiling from scratch for 160 s (H100). As `cuda:0` every rank of every world size shares one
    entry. NCCL finds the other GPUs by bus id, not by this process's numbering: the same P2P transport and
    speed on 2 H100s as with every GPU visible."""
    if torch.cuda.is_initialized():
        return False
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = ([e.strip() for e in inherited.split(",") if e.strip()] if inherited is not None
               else [str(i) for i in range(torch.cuda.device_count())])
    if local_rank >= len(entries):
        return False
    os.environ["CUDA_VISIBLE_DEVICES"] = entries[local_rank]
    os.environ[GPU_NUMBER] = str(local_rank)
    return True


def init_worker(backend: str, device_type: str, timeout_minutes: float, cpu_collectives: bool = False,
                store_address: str | None = None) -> torch.device:
    """Join the process group described by the standard torchrun variables and pick this rank's device.

    `cpu_collectives`: collectives on CPU tensors too (`with_cpu_collectives`); `store_address`: `host:port` of
    the store Tandem's launcher serves (its job says where), None: MASTER_ADDR/MASTER_PORT."""
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"rank {rank} needs GPU {local_rank}, but only {torch.cuda.device_count()} are visible "
                               "(check CUDA_VISIBLE_DEVICES and multi_gpu.num_gpus).")
        device = torch.device("cuda", 0 if see_only_own_gpu(local_rank) else local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = resolve_backend(backend, device_type)
    # A worker started by the user's own torchrun (or any launcher but ours) has not had them set.
    os.environ.update(store_environment())
    timeout = datetime.timedelta(minutes=timeout_minutes)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    if store_address:  # Tandem's launcher serves the store, listening on the configured address only
        kwargs["store"] = connect(store_address, timeout)
    # Otherwise (someone else's launcher, e.g. a user's own torchrun) MASTER_ADDR/MASTER_PORT, as PyTorch does.
    dist.init_process_group(backend=with_cpu_collectives(backend, cpu_collectives), rank=rank, world_size=world,
                            timeout=timeout, **kwargs)
    return device


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
