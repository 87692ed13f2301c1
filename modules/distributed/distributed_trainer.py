"""The multi-process trainer: the same loop as `GenericTrainer`, with DDP or FSDP as its parallelism.

What changes with N processes lives here and in the parallelism it chooses: this class joins the
process group, chooses the strategy once (`multi_gpu.strategy`, `strategy.py`: every rank takes rank
0's decision) and builds its parallelism - `ddp.DDPParallelism` or `fsdp.FSDPParallelism` - which the
loop asks for placement, wrapping, gradient sync, and how outputs are written (`trainer/parallelism.py`).
The sampler, rank-0-only writing, LR scaling and the loss/command exchange use the rank/world helpers
in `dist_utils`, which the base loop already calls and which are no-ops in one process.
"""
from __future__ import annotations

import gc
import logging
import time

import torch

from modules.config.validation import fsdp_blockers
from modules.distributed.ddp import DDPParallelism
from modules.distributed.fsdp import FSDPParallelism
from modules.distributed.process_group import destroy, init_worker
from modules.distributed.strategy import choose_strategy
from modules.trainer.base_trainer import BaseTrainer
from modules.trainer.parallelism import Parallelism
from modules.util import dist_utils as du

log = logging.getLogger("tandem")


class DistributedTrainer(BaseTrainer):
    def __init__(self, cfg, callbacks=None, inbox=None, device_type: str = "cuda", resume: str | None = None,
                 run_id: str | None = None) -> None:
        super().__init__(cfg, callbacks, inbox, resume, run_id)
        self.device_type = device_type

    def setup_environment(self) -> None:
        m = self.cfg.multi_gpu
        parts = self.start_phases.parts.setdefault("set-up", {})
        arrived, started = time.time(), time.perf_counter()
        self.device = init_worker(m.backend, self.device_type, m.timeout_minutes, cpu_collectives=m.fsdp_cpu_offload)
        joined = time.perf_counter() - started
        # Joining waits for the last rank to arrive: a slow start elsewhere, not a slow process group.
        # (Clocks of other machines may differ: the wait is bounded by the time the join took.)
        waited = min(joined, max(0.0, max(du.all_gather_objects(arrived)) - arrived))
        parts["waiting for the last rank to start"] = waited
        parts["process group"] = joined - waited
        self.configure_backends()
        started = time.perf_counter()
        self.parallel = self.choose_parallelism()
        parts["choosing the strategy"] = time.perf_counter() - started

    def choose_parallelism(self) -> Parallelism:
        """`multi_gpu.strategy`, or what `auto` makes of it from the smallest free GPU memory of all ranks;
        every rank takes rank 0's decision."""
        free = None
        if self.device.type == "cuda":
            free = du.all_gather_objects(torch.cuda.mem_get_info(self.device)[0] / 1024 ** 3)
        # Every rank sizes the model at the same time: the estimate imports diffusers and builds the model on
        # `meta` (~10 s the first time). Made on rank 0 alone, the other ranks first waited for it, then spent
        # that time again on their own imports while rank 0 waited for them (GPU runs: ~10 s per start).
        mine = choose_strategy(self.cfg, du.world_size(), self.device.type, min(free) if free else None)
        choice = du.broadcast_object(mine)
        log.info("Multi-GPU strategy: %s (%s).", choice.strategy.upper(), choice.reason)
        if choice.strategy == "ddp":
            return DDPParallelism(self.cfg.multi_gpu, self.device)
        blockers = fsdp_blockers(self.cfg)
        if blockers:  # validation refuses them with strategy fsdp; a config edited since cannot slip through
            raise ValueError(f"multi_gpu.strategy fsdp: {'; '.join(blockers)}.")
        return FSDPParallelism(self.cfg.training, self.cfg.multi_gpu.fsdp_cpu_offload, self.device)

    def teardown(self) -> None:
        # DDP holds the process group, and the trainer's reference cycles kept it alive until interpreter
        # exit, where freeing gloo's group has aborted finished workers ("terminate called without an
        # active exception", pytorch/pytorch#179291). Where the process may still go through that exit (a
        # failed run), free it now, while everything it needs is alive. A run that ended leaves through
        # `exit_now`, which skips it; there the full collection only cost time: 3-4 s from `done` to the
        # exit after a cold torch.compile (its millions of objects; H100 hosts), 0.57 s against 0.09 s
        # without it on a 2-core machine.
        self.model = None
        if not self.ended:
            gc.collect()
        destroy()
