"""The numbers behind the multi-GPU frame's live line.

"World size 2 · global batch 16 (8 x 1 x 2) · LR 1e-4 -> 2e-4 (linear)": the config and the GPUs the
GUI can see, resolved by `modules.launch.spec.resolve_launch` as the launcher resolves them, so
the user sees the effect of batch, accumulation, GPU selection and LR scaling before starting. Below it
the memory line (`memory_line`): the memory plan for the chosen GPUs (or `multi_gpu.memory_limit_gib`)
and its estimate per GPU, or the smallest changes that would fit.
"""
from __future__ import annotations

from dataclasses import dataclass

from modules.config import TrainConfig
from modules.launch.layout import ParallelLayout
from modules.launch.spec import resolve_launch
from modules.util.batch_slice import describe_split, parse_split


@dataclass(frozen=True)
class MultiGPUSummary:
    world_size: int
    per_gpu_batch: int
    accumulation: int
    base_lr: float
    lr: float
    scaling: str
    cpu: bool
    global_batch: int
    """The launch's global batch, as `resolve_launch` computed it."""
    split: str = "equal"
    """multi_gpu.batch_split as set: equal, auto, or a list such as 6,2."""
    processes_here: int = 0
    """Processes on this machine (several machines: fewer than world_size); 0: all of them."""
    layout: ParallelLayout = ParallelLayout()
    """How the processes split the batch: one slice per data-parallel group of `multi_gpu.context_parallel`."""

    def line(self) -> str:
        if self.world_size < 1:
            return "No GPU visible: choose CPU processes to try multi-process training."
        unit = "CPU processes" if self.cpu else "World size"
        lr = f"LR {format_lr(self.base_lr)}"
        if self.scaling != "none" and self.world_size > 1:
            lr += f" -> {format_lr(self.lr)} ({self.scaling})"
        return f"{unit} {self.world_size} · {self.batch_text()} · {lr}"

    def batch_text(self) -> str:
        """How the global batch is made: `global batch 16 (8 x 1 x 2)`, or its split over unequal GPUs."""
        if self.layout.context > 1:
            return (f"global batch {self.global_batch} ({self.per_gpu_batch} x {self.accumulation} x "
                    f"{self.layout.data} group(s) of {self.layout.context}, each sample split over its group)")
        equal = f"global batch {self.global_batch} ({self.per_gpu_batch} x {self.accumulation} x {self.world_size})"
        if self.world_size < 2 or self.split.strip().lower() in ("", "equal"):
            return equal
        if self.split.strip().lower() == "auto":
            return equal + ", split at start by each GPU's memory and speed"
        here = self.processes_here or self.world_size
        try:
            sizes = parse_split(self.split, here, self.per_gpu_batch)
        except ValueError:
            return equal  # mid-edit: validation names the problem
        unit = "process" if self.cpu else "GPU"  # CPU processes are not GPUs
        if here < self.world_size:
            split = " + ".join(f"{size} on {unit} {i}" for i, size in enumerate(sizes))
            return f"{equal}, this machine's {sum(sizes)} = {split}"
        text = describe_split(sizes, [f"{unit} {i}" for i in range(self.world_size)])
        return text + (f" (x {self.accumulation} accumulation)" if self.accumulation > 1 else "")


def format_lr(value: float) -> str:
    """`0.0001` -> `1e-4`, `0.00014142` -> `1.41e-4`, `0.5` -> `0.5`."""
    if value == 0:
        return "0"
    if 1e-2 <= abs(value) < 1e3:
        return f"{value:.3g}"
    mantissa, exponent = f"{value:.2e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def summarize(cfg: TrainConfig, visible_gpus: int) -> MultiGPUSummary:
    launch = resolve_launch(cfg, visible_gpus)
    return MultiGPUSummary(world_size=launch.world_size, per_gpu_batch=launch.per_gpu_batch,
                           accumulation=launch.accumulation, base_lr=launch.base_lr, lr=launch.lr,
                           scaling=launch.lr_scaling, cpu=launch.multi_process and launch.device_type == "cpu",
                           split=cfg.multi_gpu.batch_split, processes_here=launch.processes_here,
                           global_batch=launch.global_batch, layout=launch.layout)


LOOPBACK = ("127.", "localhost", "::1")
"""Addresses that reach only the machine itself."""


def nodes_and_restarts_line(cfg) -> str:
    """What the restart and several-machines settings do, in one or two sentences (empty when both are off)."""
    m, s = cfg.multi_gpu, cfg.save
    parts = []
    if m.nnodes > 1:
        where = f"{m.master_addr}:{m.master_port}" if m.master_port else \
            f"{m.master_addr} at the port set in Port - the same fixed port on every machine"
        parts.append(f"This machine is node {m.node_rank} of {m.nnodes}: start the same config and dataset on every "
                     f"machine, each with its own node number; node 0 listens on {where}.")
        if m.master_addr.strip().lower().startswith(LOOPBACK):
            parts.append(f"{m.master_addr} reaches only this machine: set Rendezvous address to node 0's network "
                         "address (the same on every machine).")
    if m.max_restarts > 0:
        parts.append(f"After a failure the workers restart up to {m.max_restarts} time(s) and continue from the "
                     f"newest backup.")
        if not (s.backup_every_n_minutes > 0 or s.backup_every_n_steps > 0):
            # What the launcher adds (modules/distributed/launch.py): an epoch can be long to lose.
            also = " also" if s.backup_every_n_epochs > 0 else ""
            parts.append(f"Backups are{also} written every 10 minutes, as no backup cadence by steps or minutes "
                         "is set (Backup & Save).")
    if m.min_gpus > 0 and m.nnodes > 1:
        parts.append(f"A lost machine is left behind while {m.min_gpus} or more GPUs remain (global batch kept).")
    return " ".join(parts)


def memory_line(cfg: TrainConfig, world: int, cards: list[float] | None) -> str:
    """"Memory plan for 2 GPU(s) of 24 GiB (limit): FSDP + fp8 base, ~17.9 GiB per GPU · faster plans do not
    fit: DDP; DDP + fp8 base; FSDP" - the plan `scripts/check_multi_gpu.py --plan-for` prints, for the chosen
    GPUs (`cards`: each one's memory; `multi_gpu.memory_limit_gib` caps it). Sized from the model's files
    without torch where they describe it; otherwise the shapes are built, which imports torch (the frame
    calls this on a worker thread)."""
    return _plan_line(cfg, max(world, 2), cards)


def one_gpu_memory_line(cfg: TrainConfig, card: float) -> str:
    """"Memory plan for one GPU of 24 GiB (card): one process + fp8 base + layer offload (32 of 60 blocks), ~14.1
    GiB per GPU · sets ... · faster plans do not fit: ..." - the plan a run of one process makes for its GPU
    (`card`: its memory; `multi_gpu.memory_limit_gib` caps it), as `memory_line` for several."""
    return _plan_line(cfg, 1, [card])


def _plan_line(cfg: TrainConfig, world: int, cards: list[float] | None) -> str:
    from modules.planning.memory_report import memory_line as plan_line
    from modules.planning.model_sizes import SizesUnavailable, model_sizes

    try:
        try:
            sizes = model_sizes(cfg)
        except SizesUnavailable:
            from modules.distributed.memory_estimate import sizes as sizes_with_torch
            sizes = sizes_with_torch(cfg)
        return plan_line(cfg, world, cards, sizes)
    except (OSError, ValueError) as e:
        return f"Memory estimate: none for this config ({e})."
