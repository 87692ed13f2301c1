"""DDP or FSDP: `multi_gpu.strategy`, and what `auto` picks from the memory estimate.

DDP keeps a whole copy of the model, its gradients and optimizer state on every GPU and is the fastest
way to train anything that fits (PyTorch's FSDP2 was 3-6x slower than DDP for a small-batch LoRA in
SimpleTuner's measurements). FSDP shards them, so a full fine-tune larger than one GPU trains at all.
`auto` therefore picks DDP whenever the estimate says it fits each GPU - a LoRA that fits always gets
DDP - and FSDP only when it does not.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from modules.config.launch_spec import resolve_launch
from modules.config.validation import fsdp_blockers

SAFETY_FRACTION = 0.9
"""Share of the free GPU memory an estimate may fill: the allocator rounds up and fragments."""


@dataclass(frozen=True)
class StrategyChoice:
    strategy: str
    """`ddp` or `fsdp`."""
    reason: str
    """One sentence for the start-up log: why this strategy."""


def planned_world_size(cfg, visible_gpus: int) -> int:
    """The number of processes a multi-GPU start with `cfg` would run (as the launchers decide it)."""
    multi = dataclasses.replace(cfg, multi_gpu=dataclasses.replace(cfg.multi_gpu, enabled=True))
    return resolve_launch(multi, visible_gpus).world_size


def choose_strategy(cfg, world_size: int, device_type: str, free_gib: float | None,
                    estimates: dict | None = None) -> StrategyChoice:
    """The strategy for `cfg` on `world_size` processes whose GPUs have at least `free_gib` free each.

    `estimates`: `{"ddp": estimate(cfg), "fsdp": estimate_fsdp(...)}` if already made (else made here
    when needed). Never raises for a model it cannot size: `auto` then keeps DDP and says why.
    """
    requested = cfg.multi_gpu.strategy
    if requested in ("ddp", "fsdp"):
        return StrategyChoice(requested, f"multi_gpu.strategy is {requested}")
    if world_size < 2:
        return StrategyChoice("ddp", "one process: nothing to shard")
    if device_type != "cuda":
        return StrategyChoice("ddp", "CPU processes have no GPU memory to save; DDP is the faster strategy")
    if free_gib is None:
        return StrategyChoice("ddp", "the free GPU memory is unknown; DDP (set multi_gpu.strategy to fsdp for "
                                     "a model larger than one GPU)")
    from modules.distributed import memory_estimate

    try:
        estimates = estimates or strategy_estimates(cfg, world_size)
    except (memory_estimate.EstimateError, OSError, ValueError) as e:
        return StrategyChoice("ddp", f"no memory estimate for this model ({e}); DDP (set multi_gpu.strategy to "
                                     "fsdp if it does not fit one GPU)")
    ddp, fsdp = estimates["ddp"], estimates["fsdp"]
    usable = free_gib * SAFETY_FRACTION
    unmeasured = "" if ddp["activations_measured"] else " before activations (not measured for this model)"
    if ddp["total"] <= usable:
        return StrategyChoice("ddp", f"DDP needs ~{ddp['total']:.1f} GiB per GPU{unmeasured}, which fits the "
                                     f"{free_gib:.1f} GiB free")
    blockers = fsdp_blockers(cfg)
    if blockers:
        return StrategyChoice("ddp", f"DDP would need ~{ddp['total']:.1f} GiB per GPU{unmeasured}, more than the "
                                     f"{free_gib:.1f} GiB free, but FSDP cannot train this config ("
                                     f"{'; '.join(blockers)}); DDP is tried")
    fits = "fits" if fsdp["total"] <= usable else "still does not fit (lower the batch size, turn on gradient " \
                                                   "checkpointing or multi_gpu.fsdp_cpu_offload)"
    return StrategyChoice("fsdp", f"DDP would need ~{ddp['total']:.1f} GiB per GPU{unmeasured}, more than the "
                                  f"{free_gib:.1f} GiB free; FSDP over {world_size} GPUs needs ~"
                                  f"{fsdp['total']:.1f} GiB per GPU, which {fits}")


def strategy_estimates(cfg, world_size: int) -> dict:
    """The per-GPU estimates of both strategies: `{"ddp": ..., "fsdp": ...}` (FSDP as configured:
    with CPU offload when `multi_gpu.fsdp_cpu_offload` is on)."""
    from modules.distributed import memory_estimate

    ddp = memory_estimate.estimate(cfg)
    return {"ddp": ddp, "fsdp": memory_estimate.estimate_fsdp(ddp, max(world_size, 1), cfg.multi_gpu.fsdp_cpu_offload)}
