"""`multi_gpu.memory_limit_gib`: each GPU held to the memory the run was planned for, and what an
out-of-memory error then says.

`hold_to_memory_limit` caps this process's CUDA caching allocator at the limit
(`torch.cuda.set_per_process_memory_fraction`), so that an 80 GiB card behaves like a 24 GiB one - how
plans for small cards are tested on large ones - and a run planned for 24 GiB never takes more. What
the CUDA context itself takes (~0.5 GiB) lies outside that cap; on a real 24 GB card it is inside.

`explained` turns PyTorch's out-of-memory error, wherever it happens (placing the model, caching, a
step, sampling), into one that names the GPU, what it asked for and had in use, its limit, what the plan
estimated and what to change: the run ends with the figure instead of a CUDA traceback.
"""
from __future__ import annotations

import logging
import os
import re

import torch

from modules.planning.memory_need import GIB
from modules.planning.memory_plan import own_limit
from modules.util import dist_utils as du

log = logging.getLogger("tandem")


class MemoryLimitExceeded(RuntimeError):
    """A GPU needed more memory than it has or may use; the message gives the figures and what to change."""


def _place() -> tuple[int, int, int]:
    """(rank, local rank, processes on this machine) from the launch's variables: also after the process
    group is gone (an error is explained once the trainer has torn it down)."""
    rank = int(os.environ.get("RANK", du.rank()))
    world = int(os.environ.get("WORLD_SIZE", du.world_size()))
    return rank, int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world))


def hold_to_memory_limit(cfg, device: torch.device) -> float | None:
    """Cap this process's GPU at its `multi_gpu.memory_limit_gib` (never above the card); the cap in GiB, or
    None when no limit is set."""
    if device.type != "cuda":
        return None
    limit = own_limit(cfg, *_place()[1:])
    if limit is None:
        return None
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    if limit > total:
        log.warning("GPU %d has %.1f GiB, less than its multi_gpu.memory_limit_gib %.1f: its own size is the limit.",
                    du.gpu_number(device), total, limit)
        limit = total
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    log.info("GPU %d held to %.1f GiB of its %.1f GiB (multi_gpu.memory_limit_gib).", du.gpu_number(device), limit, total)
    return limit


def explained(error: BaseException, trainer) -> BaseException:
    """`error` as a `MemoryLimitExceeded` with the figures when it is PyTorch's out-of-memory error, else itself."""
    if not isinstance(error, torch.OutOfMemoryError):
        return error
    return MemoryLimitExceeded(describe(error, trainer))


def describe(error: BaseException, trainer) -> str:
    cfg, device = trainer.cfg, getattr(trainer, "device", None)
    rank, local_rank, local_world = _place()
    where = f"GPU {du.gpu_number(device)}" if device is not None and device.type == "cuda" else f"rank {rank}"
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(error))
    when = (f" at step {trainer.global_step + 1}" if getattr(trainer, "first_step_done", False)
            else " before the first step" if getattr(trainer, "model", None) is not None else " while setting up")
    text = f"{where} ran out of memory{when}"
    if asked:
        text += f": it asked for {asked.group(1)} more"
    if device is not None and device.type == "cuda":
        text += (f"{',' if asked else ':'} with {torch.cuda.memory_allocated(device) / GIB:.1f} GiB in use "
                 f"(peak {torch.cuda.max_memory_allocated(device) / GIB:.1f} GiB)")
    limit = own_limit(cfg, local_rank, local_world)
    if limit is not None:
        text += f", beyond its limit of {limit:g} GiB (multi_gpu.memory_limit_gib)"
    elif device is not None and device.type == "cuda":
        text += f", beyond its {torch.cuda.get_device_properties(device).total_memory / GIB:.1f} GiB"
    strategy = getattr(trainer, "strategy", None)
    plan = getattr(strategy, "plan", None) or getattr(trainer, "memory_plan", None)  # N processes, or one
    if plan is not None:
        text += f". The plan, {plan.name}, estimated {plan.peaks[min(rank, len(plan.peaks) - 1)]:.1f} GiB for it"
    return text + ". To fit: " + "; ".join(advice(cfg)) + "."


def advice(cfg) -> list[str]:
    """What to change, most effective first, for a run that ran out of memory (the plan's own choice was
    too close: each of these leaves more room)."""
    t, model, m = cfg.training, cfg.model, cfg.multi_gpu
    found = []
    if t.batch_size > 1:
        found.append(f"lower training.batch_size (now {t.batch_size}; raise training.gradient_accumulation_steps "
                     "to keep the global batch)")
    if not t.gradient_checkpointing:
        found.append("turn on training.gradient_checkpointing")
    if t.method == "lora" and model.unet_dtype != "fp8" and t.precision == "bf16":
        found.append("set model.unet_dtype to fp8")
    if not (m.strategy == "fsdp" and m.fsdp_cpu_offload):
        found.append("set multi_gpu.strategy to fsdp with multi_gpu.fsdp_cpu_offload on (the plan that saves the most)")
    if m.memory_limit_gib.strip():
        found.append("raise multi_gpu.memory_limit_gib if the card has more")
    found.append("scripts/check_multi_gpu.py --config-path <config> --plan-for <GPUs>x<GiB> shows the plans")
    return found
