"""DDP, FSDP and the memory plan: what `multi_gpu.strategy` makes of a run, decided once at start.

DDP keeps a whole copy of the model, its gradients and optimizer state on every GPU and is the fastest
way to train anything that fits (PyTorch's FSDP2 was 3-6x slower than DDP for a small-batch LoRA in
SimpleTuner's measurements). With `auto`, the memory plan (`modules/planning/memory_plan.py`) takes DDP
whenever it fits every GPU and otherwise the fastest plan that does: an fp8 base, FSDP, activation
checkpointing and offloading, CPU offload of the shards. `ddp` or `fsdp` set explicitly is used as
configured (its estimate is still reported).

Every rank makes the same choice from the same numbers (each rank's card, gathered) and takes rank 0's.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from modules.planning.host_need import HostRoom
from modules.launch.spec import resolve_launch
from modules.planning.memory_plan import SAFETY_FRACTION, NoPlanFits, Plan, choose_plan  # noqa: F401 - re-exported


@dataclass(frozen=True)
class StrategyChoice:
    strategy: str
    """`ddp` or `fsdp`."""
    reason: str
    """One sentence for the start-up log: why this strategy."""
    plan: Plan | None = None
    """The memory plan behind it (its estimate per GPU, what it sets); None where none was made."""
    seconds: dict[str, float] = field(default_factory=dict)
    """How long sizing the model and choosing the plan took (the start-up report's parts)."""

    def describe(self) -> str:
        return self.plan.describe() if self.plan is not None else f"Multi-GPU strategy: {self.strategy.upper()} ({self.reason})."


def planned_world_size(cfg, visible_gpus: int) -> int:
    """The number of processes a multi-GPU start with `cfg` would run (as the launchers decide it)."""
    multi = dataclasses.replace(cfg, multi_gpu=dataclasses.replace(cfg.multi_gpu, enabled=True))
    return resolve_launch(multi, visible_gpus).world_size


def choose_strategy(cfg, world_size: int, device_type: str, cards: float | list[float] | None,
                    source: str = "free memory", model=None, refuse: bool = False,
                    host: HostRoom | None = None) -> StrategyChoice:
    """The strategy for `cfg` on `world_size` processes whose GPUs have `cards` GiB each (one number: all
    alike; `source` says what the numbers are: free memory or `multi_gpu.memory_limit_gib`), in machines with
    `host` memory (None: not checked).

    `model`: the model's sizes if already read. Never raises for a model it cannot size or a config that
    fits nothing unless `refuse` (the launcher's check): `auto` then keeps DDP, or the most frugal plan,
    and says why.
    """
    requested = cfg.multi_gpu.strategy
    explicit = requested in ("ddp", "fsdp")
    if world_size < 2:
        return StrategyChoice("ddp", "one process: nothing to shard")
    if device_type != "cuda":
        return StrategyChoice(requested if explicit else "ddp", f"multi_gpu.strategy is {requested}" if explicit else
                              "CPU processes have no GPU memory to save; DDP is the faster strategy")
    if cards is None:
        return StrategyChoice(requested if explicit else "ddp", f"multi_gpu.strategy is {requested}" if explicit else
                              "the free GPU memory is unknown; DDP (set multi_gpu.strategy to fsdp for a model larger "
                              "than one GPU)")
    caps = [float(cards)] * world_size if isinstance(cards, (int, float)) else list(cards)
    from modules.distributed import memory_estimate

    started = time.perf_counter()
    try:
        model = model or memory_estimate.sizes(cfg)
    except (memory_estimate.EstimateError, OSError, ValueError) as e:
        if explicit:
            return StrategyChoice(requested, f"multi_gpu.strategy is {requested} (no memory estimate: {e})")
        return StrategyChoice("ddp", f"no memory estimate for this model ({e}); DDP (set multi_gpu.strategy to fsdp if "
                                     "it does not fit one GPU)")
    sized = time.perf_counter()
    plan = choose_plan(cfg, model, caps, source, refuse=refuse, host=host)
    seconds = {"sizing the model": sized - started, "choosing the plan": time.perf_counter() - sized}
    reason = f"multi_gpu.strategy is {requested}" if explicit else f"the memory plan: {plan.name}"
    return StrategyChoice(plan.strategy, reason, plan, seconds)


def check_cards(cfg, spec) -> StrategyChoice | None:
    """The launcher's check, before any worker starts: a plan that fits the cards of this launch
    (`multi_gpu.memory_limit_gib`, never more than the card, or each card's size; machines alike) and this
    machine's available host memory for its processes, or
    `NoPlanFits` naming the smallest changes that would fit. None where nothing is planned (CPU processes,
    one process, a model the estimate cannot size)."""
    if spec.device_type != "cuda" or spec.world_size < 2 or not spec.gpus:
        return None
    import torch

    from modules.planning.host_need import this_machine
    from modules.planning.memory_need import GIB
    from modules.planning.memory_plan import memory_limits

    here = [torch.cuda.get_device_properties(i).total_memory / GIB for i in spec.gpus]
    limits = memory_limits(cfg.multi_gpu.memory_limit_gib, len(here))
    if limits is not None:
        here = [min(limit, card) for limit, card in zip(limits, here)]
    cards = (here * spec.nnodes)[:spec.world_size]
    source = "multi_gpu.memory_limit_gib" if limits is not None else "the cards' memory"
    choice = choose_strategy(cfg, spec.world_size, "cuda", cards, source, refuse=True,
                             host=this_machine(spec.processes_here))
    return choice if choice.plan is not None else None
