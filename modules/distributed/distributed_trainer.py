"""The multi-process trainer: the same loop as `GenericTrainer`, with DDP or FSDP as its parallelism.

What changes with N processes lives here and in the parallelism it chooses: this class joins the
process group, chooses the strategy once (`multi_gpu.strategy`, `strategy.py`: with `auto` the memory
plan for every rank's card; every rank takes rank 0's decision, and trains the config as the plan sets
it) and builds its parallelism - the strategy found by name in `STRATEGIES` (`ddp.DDPParallelism`,
`fsdp.FSDPParallelism`), over the run's layout (`ParallelLayout`, as the launch resolved it, with the
weights sharded or not) and its device mesh (`mesh.py`), with context parallelism composed in where
groups have several processes - which the loop asks for placement, wrapping, each step's forward and
backward passes, and how outputs are written (`trainer/parallelism.py`).
The sampler, rank-0-only writing, LR scaling and the loss/command exchange use the rank/world helpers
in `dist_utils`, which the base loop already calls and which are no-ops in one process.
"""
from __future__ import annotations

import gc
import logging
import time

import torch

from modules.planning.memory_need import GIB
from modules.planning.memory_plan import own_limit
from modules.config.validation import context_parallel_problems
from modules.distributed import failures
from modules.distributed.ddp import DDPParallelism
from modules.distributed.context_parallel import ContextParallel
from modules.distributed.fsdp import FSDPParallelism
from modules.distributed.mesh import LayoutMesh
from modules.distributed.process_group import destroy, init_worker
from modules.distributed.strategy import StrategyChoice, choose_strategy
from modules.distributed.watchdog import Watchdog
from modules.launch.layout import ParallelLayout
from modules.trainer.base_trainer import BaseTrainer
from modules.trainer.parallelism import Parallelism
from modules.util import dist_utils as du

log = logging.getLogger("tandem")

STRATEGIES: dict[str, type[Parallelism]] = {strategy.name: strategy for strategy in (DDPParallelism, FSDPParallelism)}
"""The multi-process parallelisms by the name `multi_gpu.strategy` (or the memory plan) gives them; each builds itself
for a run (`for_run`)."""


class DistributedTrainer(BaseTrainer):
    def __init__(self, cfg, callbacks=None, inbox=None, device_type: str = "cuda", resume: str | None = None,
                 run_id: str | None = None, launch=None, scan=None, rendezvous: str | None = None,
                 hand_ins=None) -> None:
        """`rendezvous`: `host:port` of the store the launcher serves (None: MASTER_ADDR/MASTER_PORT);
        `hand_ins`: as `BaseTrainer`'s."""
        super().__init__(cfg, callbacks, inbox, resume, run_id, launch, scan, hand_ins)
        self.device_type = device_type
        self.rendezvous = rendezvous
        self.strategy: StrategyChoice | None = None
        """The strategy and memory plan chosen at start (`choose_parallelism`)."""
        self.measured_peaks: list[float] = []
        """Each GPU's peak memory after the first step, GiB."""

    def setup_environment(self) -> None:
        m = self.cfg.multi_gpu
        parts = self.startup.parts.setdefault("set-up", {})
        arrived, started = time.time(), time.perf_counter()
        # With strategy auto the plan may turn on CPU offload, whose collectives need gloo beside NCCL.
        self.device = init_worker(m.backend, self.device_type, m.timeout_minutes,
                                  cpu_collectives=m.fsdp_cpu_offload or m.strategy == "auto",
                                  store_address=self.rendezvous)
        joined = time.perf_counter() - started
        # Every rank has joined: from here a rank that fails, freezes or stalls ends the job within seconds.
        self.watchdog = Watchdog.start(self.heartbeat, du.rank(), du.world_size(), m.stall_seconds,
                                       failures.failures_folder(self.paths.workspace), self.rendezvous)
        # Joining waits for the last rank to arrive: a slow start elsewhere, not a slow process group.
        # (Clocks of other machines may differ: the wait is bounded by the time the join took.)
        waited = min(joined, max(0.0, max(du.all_gather_objects(arrived)) - arrived))
        parts["waiting for the last rank to start"] = waited
        parts["process group"] = joined - waited
        self.configure_backends()
        started = time.perf_counter()
        self.parallel = self.choose_parallelism()
        parts.update(self.strategy.seconds)
        parts["choosing the strategy"] = time.perf_counter() - started - sum(self.strategy.seconds.values())

    def choose_parallelism(self) -> Parallelism:
        """`multi_gpu.strategy`, or the memory plan `auto` makes for every rank's card (its free memory, or
        `multi_gpu.memory_limit_gib`); every rank takes rank 0's decision, and the config becomes the plan's."""
        cards, source = None, "free memory"
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0] / GIB
            limit = own_limit(self.cfg, du.local_rank(), du.local_world_size())
            cards = du.all_gather_objects(free if limit is None else min(free, limit))
            source = "free memory" if limit is None else "multi_gpu.memory_limit_gib"
        # Every rank sizes the model at once (milliseconds from its files; a model that must be built on
        # `meta` is built on every rank at the same time rather than on rank 0 while the others wait).
        mine = choose_strategy(self.cfg, du.world_size(), self.device.type, cards, source,
                               host=self.host_room() if self.device.type == "cuda" else None)
        self.strategy = choice = du.broadcast_object(mine)
        log.info(choice.describe())
        if choice.plan is not None:
            self.cfg = choice.plan.apply(self.cfg)
        problems = context_parallel_problems(self.cfg, du.world_size())
        if problems:  # validation could not know the number of processes (torchrun, all visible GPUs)
            raise ValueError(" ".join(problems))
        strategy = STRATEGIES[choice.strategy]
        mesh = LayoutMesh(self.round_layout().sharded(not strategy.holds_whole_model), self.device.type)
        parallel = strategy.for_run(self.cfg, self.device, mesh, choice.plan)
        parallel.offload_activations(self.cfg.training, self.cfg.multi_gpu.activation_offload, self.device)
        if mesh.layout.context > 1:
            parallel.sequences = ContextParallel(mesh)
        return parallel

    def round_layout(self) -> ParallelLayout:
        """How this round's processes split the training, as the launch resolved it (a user's own torchrun
        without Tandem's launch: its processes in groups of `multi_gpu.context_parallel`)."""
        layout = (self.launch.layout if self.launch is not None else
                  ParallelLayout.of(du.world_size(), self.cfg.multi_gpu.context_parallel))
        if layout.processes != du.world_size():
            raise ValueError(f"the launch planned {layout.describe()}, but {du.world_size()} processes joined")
        return layout

    @staticmethod
    def host_room():
        """The host memory rank 0's plan may use (`host_need.py`): its machine's available memory and what the
        machine's ranks hold already, which the plan counts again (`PROCESS_HOST_GIB` each)."""
        from modules.planning.host_need import HostRoom, available_gib
        from modules.model.shared_host_copy import machine
        from modules.util.host_memory import process_usage

        usage = process_usage()
        figures = du.all_gather_objects((machine(), available_gib(), usage["pss"] if usage else 0))
        first, available, _ = figures[0]
        if available is None:
            return None
        here = [pss for where, _, pss in figures if where == first]
        return HostRoom(available + sum(here) / GIB, "MemAvailable", len(here))

    def report_first_step(self, started: float, loaded: float, workers_s: float) -> None:
        """The first step's times, and each GPU's measured peak beside the plan's estimate and the card."""
        super().report_first_step(started, loaded, workers_s)
        if self.parallel.offload is not None:  # every rank swaps alike
            from modules.model.shared_host_copy import host_figures, host_memory_line
            log.info(host_memory_line(du.all_gather_objects(host_figures(self.parallel.offload))))
        if self.device.type != "cuda":
            return
        self.measured_peaks = du.all_gather_objects(torch.cuda.max_memory_allocated(self.device) / GIB)
        plan, listed = self.strategy.plan, lambda values: ", ".join(f"{v:.1f}" for v in values)
        estimated = f" (estimated {listed(plan.peaks)}; cards {listed(plan.capacities)} GiB)" if plan is not None else ""
        log.info("Memory after the first step: peak %s GiB%s.",
                 ", ".join(f"GPU {r} {p:.1f}" for r, p in enumerate(self.measured_peaks)), estimated)

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
        elif getattr(self, "watchdog", None) is not None:
            self.watchdog.stop()  # a failed run keeps it: it ends the process if the clean-up below hangs
        destroy()
