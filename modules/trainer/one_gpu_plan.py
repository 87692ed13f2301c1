"""The memory plan of a run on one GPU: the fastest way to train the config that fits the card, chosen before the
model loads.

On one GPU there is nothing to shard, so the plan chooses among holding the model plainly, an fp8 base,
activation checkpointing, activation offloading and layer offload of as few blocks as fit (`modules/planning/memory_plan.py`), for
`multi_gpu.memory_limit_gib` or the card's free memory, and the machine's available host memory
(`host_need.py`). A config that fits nothing is refused here - before
anything loads - naming the smallest change that fits (`NoPlanFits`); `TANDEM_SKIP_MEMORY_CHECK=1` starts it
anyway with the most frugal plan. CPU runs and models the estimate cannot size without building them train as
configured.
"""
from __future__ import annotations

import logging
import os

import torch

from modules.planning.host_need import this_machine
from modules.planning.memory_need import GIB
from modules.planning.memory_plan import Plan, choose_plan, own_limit
from modules.planning.model_sizes import SizesUnavailable, model_sizes
from modules.config.validation import parse_layer_offload

log = logging.getLogger("tandem")

SKIP_MEMORY_CHECK = "TANDEM_SKIP_MEMORY_CHECK"
"""Set to 1: a plan that does not fit is taken anyway (the estimate may be wrong for a model)."""


def plan_one_gpu(cfg, device: torch.device) -> Plan | None:
    """The plan for `cfg` on this process's GPU; None where none is made (CPU, a model not sized from its files
    or published sizes). Raises `NoPlanFits` when nothing fits."""
    if device.type != "cuda":
        return None
    try:
        sizes = model_sizes(cfg)
    except (SizesUnavailable, OSError, ValueError) as reason:
        log.info("Memory plan: none for one GPU (%s); the run trains as configured.", reason)
        return None
    free = torch.cuda.mem_get_info(device)[0] / GIB
    limit = own_limit(cfg, 0, 1)
    card, source = (free, "free memory") if limit is None else (min(free, limit), "multi_gpu.memory_limit_gib")
    host = this_machine(1, own_host_gib())
    plan = choose_plan(cfg, sizes, [card], source, refuse=os.environ.get(SKIP_MEMORY_CHECK) != "1", host=host)
    log.info(plan.describe())
    return plan


def own_host_gib() -> float:
    """GiB of host memory this process holds now (its PSS): planning inside it, its own part is in use already."""
    from modules.util.host_memory import process_usage
    usage = process_usage()
    return usage["pss"] / GIB if usage else 0.0


def layer_offload_blocks(cfg) -> int:
    """How many blocks swap as the config (after its plan) says: `auto` left unresolved swaps none."""
    try:
        return parse_layer_offload(cfg.multi_gpu.layer_offload) or 0
    except ValueError:
        return 0
