"""What a start with a config runs: how many processes, on which devices, through which launcher and
backend, and the numbers that need no data (global batch, scaled LR).

`resolve_launch` decides it for everyone: the GUI (its live line, and which script Start runs), the
launchers (`scripts/train_multi_gpu.py`, `start-multi-gpu`), `scripts/train.py`, and a worker that a
user's own torchrun started. Torch-free, so that the GUI can import it: the facts of the machine
(how many GPUs are visible, CUDA_VISIBLE_DEVICES, the world torchrun made) are arguments.

What `multi_gpu.enabled` means (decided here and nowhere else): whether a Tandem start runs several
processes - the GUI's Start, and `scripts/train_multi_gpu.py`, which turns it on. `scripts/train.py`
trains in one process whatever it says (a note says so when it is on), and workers
that someone else's torchrun started train in the world torchrun made (`torchrun_world`): those
processes exist before any config is read, so the setting cannot undo them (a note says so when it is
off). The trainer never reads it: a worker trains in the world its launcher made.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from modules.config.train_config import TrainConfig
from modules.config.validation import context_parallel_problems, parse_device_indexes
from modules.launch.backends import resolve_backend
from modules.launch.layout import ParallelLayout

SINGLE = "single"
"""One process, no process group."""
EXTERNAL = "external"
"""Workers started by a launcher that is not Tandem's (the user's own torchrun)."""
TORCHRUN = "torchrun"
SPAWN = "spawn"
AUTO = "auto"
"""`multi_gpu.launcher = auto`: decided by `chosen_launcher`; never a launch's launcher."""
DEFAULT_CPU_PROCESSES = 2
"""Processes of a `--device cpu` run when `multi_gpu.num_gpus` is 0."""


@dataclass(frozen=True)
class LaunchSpec:
    launcher: str
    """`single`, `torchrun`, `spawn` (Tandem's launchers) or `external` (someone else's torchrun)."""
    world_size: int
    device_type: str
    """`cuda` or `cpu`."""
    gpus: tuple[int, ...]
    """The GPU of each rank, numbered among the visible GPUs; empty for CPU processes and one process."""
    visible_devices: str | None
    """CUDA_VISIBLE_DEVICES for the workers (physical numbers); None: leave it as it is."""
    backend: str
    """`nccl` or `gloo`; empty for one process."""
    per_gpu_batch: int
    accumulation: int
    base_lr: float
    lr_scaling: str
    """The LR scaling that applies: `multi_gpu.lr_scaling` for several processes, else `none`."""
    problem: str | None = None
    """Why this launch cannot start here (the message says what to change); None when it can."""
    nnodes: int = 1
    """Machines training together; `world_size` counts the processes of all of them."""
    node_rank: int = 0
    """This machine's number among them (0 serves the rendezvous and holds global rank 0)."""
    local_world_size: int = 0
    """Processes started on this machine (0 in specs written before several machines: `world_size`)."""
    max_restarts: int = 0
    """How often torchrun's agent restarts every worker after a failure (`multi_gpu.max_restarts`)."""
    min_nodes: int = 0
    """The fewest machines the run continues on after losing some (`multi_gpu.min_gpus`); 0: all of them."""
    layout: ParallelLayout | None = None
    """How the processes split the training: data-parallel groups of `multi_gpu.context_parallel` processes each
    (None when made: `world_size` processes, each its own group). Whether the weights are sharded is the
    worker's decision (`multi_gpu.strategy`, with `auto` from each card's memory): not yet here."""
    global_batch: int = 0
    """Samples per optimizer step over all processes: per-GPU batch x accumulation x data slices of the launch
    (0 when made: computed). A round on fewer processes (a lost machine) keeps it by accumulating more."""
    lr: float | None = None
    """The denoiser's learning rate: the base LR scaled for the launch's world size (None when made:
    computed). It stays the launch's when a round runs on fewer processes: the global batch is kept, so
    is the result; the base LR while the scaling mode is unknown (mid-edit in the GUI)."""
    text_encoder_base_lr: float | None = None
    """`training.text_encoder_learning_rate` where set; None: the text encoders train at `base_lr`."""
    text_encoder_lr: float | None = None
    """The text encoders' learning rate, scaled as `lr` is (None when made: computed)."""
    lr_factor: float | None = None
    """What the LR scaling multiplies each learning rate by (None when made: computed)."""

    def __post_init__(self) -> None:
        # The one place the global batch and the scaled LRs are computed; every later copy (a smaller round,
        # the job file, the run numbers, the optimizer's groups, a LoRA's metadata) carries them as they were.
        if self.layout is None:
            object.__setattr__(self, "layout", ParallelLayout.of(max(1, self.world_size)))
        elif self.layout.processes != max(1, self.world_size):
            raise ValueError(f"launch: a layout of {self.layout.describe()} for {self.world_size} processes")
        if not self.global_batch:
            object.__setattr__(self, "global_batch", self.per_gpu_batch * self.accumulation * self.data_world)
        if self.lr_factor is None:
            object.__setattr__(self, "lr_factor", lr_factor(self.lr_scaling, self.data_world))
        if self.lr is None:
            object.__setattr__(self, "lr", self.base_lr * self.lr_factor)
        if self.text_encoder_lr is None:
            object.__setattr__(self, "text_encoder_lr", (self.text_encoder_base_lr or self.base_lr) * self.lr_factor)

    @property
    def data_world(self) -> int:
        """Slices of each global batch: the processes, or their context-parallel groups."""
        return self.layout.data

    @property
    def processes_here(self) -> int:
        """Workers this machine starts."""
        return self.local_world_size or self.world_size

    @property
    def multi_process(self) -> bool:
        return self.launcher != SINGLE

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LaunchSpec:
        return cls(**{**data, "gpus": tuple(data["gpus"]), "layout": ParallelLayout(**data["layout"])})


def lr_factor(mode: str, world_size: int) -> float:
    """What the LR scaling `mode` multiplies the learning rates by for `world_size` data slices; 1 while the mode
    is unknown (mid-edit in the GUI: validation names it)."""
    try:
        return lr_scale_factor(mode, max(world_size, 1))
    except ValueError:
        return 1.0


def lr_scale_factor(mode: str, world_size: int) -> float:
    if mode == "linear":
        return float(world_size)
    if mode == "sqrt":
        return math.sqrt(world_size)
    if mode == "none":
        return 1.0
    raise ValueError(f"multi_gpu.lr_scaling: unknown mode {mode!r}; use none, linear or sqrt")


def resolve_launch(cfg: TrainConfig, visible_gpus: int, *, cuda_visible: str | None = None,
                   torchrun_world: int | None = None) -> LaunchSpec:
    """The launch a start with `cfg` makes on a machine that shows `visible_gpus` CUDA GPUs.

    `cuda_visible`: the CUDA_VISIBLE_DEVICES the start inherits (the chosen indexes are relative to
    it); `torchrun_world`: WORLD_SIZE of a worker that someone else's torchrun started. Never raises:
    what cannot start is in `problem`, so the GUI can show the numbers of a config being edited; the
    launchers raise it.
    """
    m, t = cfg.multi_gpu, cfg.training
    if torchrun_world is not None:
        launcher = EXTERNAL
    elif not m.enabled:
        launcher = SINGLE
    else:
        launcher = chosen_launcher(cfg)
    device_type, problem = resolve_device(cfg.general.device, visible_gpus, launcher)
    gpus: tuple[int, ...] = ()
    visible_devices = None
    if launcher == SINGLE:
        world = 1
    elif launcher == EXTERNAL:
        world = torchrun_world
    elif device_type == "cpu":
        world = m.num_gpus or DEFAULT_CPU_PROCESSES
    else:
        gpus, selection_problem = _chosen_gpus(cfg, visible_gpus)
        world = len(gpus)
        problem = problem or selection_problem
        if not problem:
            visible_devices = _physical(gpus, cuda_visible)
    local_world = world
    nodes = m.nnodes if launcher in (SPAWN, TORCHRUN) else 1
    if nodes > 1:
        world = local_world * nodes  # every machine runs the same config, so the same number of processes
    context = m.context_parallel if launcher != SINGLE else 1
    if context > 1 and not problem:
        problem = " ".join(context_parallel_problems(cfg, world)) or None
    backend = ""
    if launcher != SINGLE:
        try:
            backend = resolve_backend(m.backend, device_type)
        except RuntimeError as e:
            problem = problem or str(e)
            backend = m.backend
    return LaunchSpec(launcher=launcher, world_size=world, device_type=device_type, gpus=gpus,
                      visible_devices=visible_devices, backend=backend, per_gpu_batch=t.batch_size,
                      accumulation=t.gradient_accumulation_steps, base_lr=t.learning_rate,
                      text_encoder_base_lr=t.text_encoder_learning_rate or None,
                      lr_scaling=m.lr_scaling if launcher != SINGLE else "none", problem=problem,
                      nnodes=nodes, node_rank=m.node_rank if nodes > 1 else 0, local_world_size=local_world,
                      max_restarts=m.max_restarts if launcher == TORCHRUN else 0,
                      min_nodes=min_nodes(m.min_gpus, local_world, nodes) if launcher == TORCHRUN else 0,
                      layout=_layout(world, context))


def _layout(world: int, context: int) -> ParallelLayout:
    """`world` processes in groups of `context`; one group per process where `context` does not divide them (the
    launch's `problem` says so) or none is visible (the GUI: no launch)."""
    processes = max(1, world)
    return ParallelLayout.of(processes, context if context >= 1 and processes % context == 0 else 1)


def chosen_launcher(cfg: TrainConfig) -> str:
    """`multi_gpu.launcher`, with `auto` made torchrun where its elastic agent is needed (several machines,
    restarts), else spawn: no agent process importing PyTorch before the workers do, so the first step
    comes 10-14 s sooner on H100 hosts (docs/Performance.md, "Launchers, backups of a full fine-tune, cuDNN
    autotuning")."""
    m = cfg.multi_gpu
    if m.launcher != AUTO:
        return m.launcher
    return TORCHRUN if m.nnodes > 1 or m.max_restarts > 0 or m.min_gpus > 0 else SPAWN


def min_nodes(min_gpus: int, local_world: int, nnodes: int) -> int:
    """The machines `min_gpus` needs (each brings `local_world` GPUs); 0 when all `nnodes` are needed."""
    if min_gpus <= 0 or nnodes <= 1 or local_world <= 0:
        return 0
    return min(nnodes, max(1, math.ceil(min_gpus / local_world)))


def resolve_device(setting: str, visible_gpus: int, launcher: str = SINGLE) -> tuple[str, str | None]:
    """(`cuda` or `cpu`, the problem or None): `general.device` on this machine: one process and a user's torchrun fall back to the CPU from
    `auto`, Tandem's launchers train on GPUs unless asked for CPU processes."""
    if setting == "cpu":
        return "cpu", None
    if launcher == EXTERNAL:
        return ("cuda" if visible_gpus else "cpu"), None
    if launcher == SINGLE:
        if visible_gpus or setting == "auto":
            return ("cuda" if visible_gpus else "cpu"), None
        return "cuda", ("general.device is 'cuda' but torch sees no CUDA GPU: set it to 'auto' or 'cpu', "
                        "or install a CUDA build of torch.")
    if not visible_gpus:
        return "cuda", ("multi-GPU training needs CUDA GPUs, but torch sees none. Use --device cpu to try it "
                        "with CPU processes, or check the driver and CUDA_VISIBLE_DEVICES.")
    return "cuda", None


def _chosen_gpus(cfg: TrainConfig, visible: int) -> tuple[tuple[int, ...], str | None]:
    """The GPUs `multi_gpu.device_indexes` / `num_gpus` choose, and what is wrong with the choice."""
    m = cfg.multi_gpu
    try:
        indexes = parse_device_indexes(m.device_indexes)
    except ValueError as reason:
        return tuple(range(m.num_gpus or visible)), f"multi_gpu.device_indexes {m.device_indexes!r}: {reason}."
    if not indexes:
        count = m.num_gpus or visible
        if count > visible:
            return tuple(range(count)), (f"multi_gpu.num_gpus is {count}, but only {visible} GPU(s) are visible. "
                                         f"Set --num-gpus {visible} or fewer (0 = all).")
        return tuple(range(count)), None
    bad = [i for i in indexes if i >= visible]
    if bad:
        return tuple(indexes), (f"multi_gpu.device_indexes names GPU(s) {bad}, but only {visible} are visible "
                                f"(0..{visible - 1}).")
    if m.num_gpus and m.num_gpus != len(indexes):
        return tuple(indexes), (f"multi_gpu.num_gpus is {m.num_gpus} but device_indexes lists {len(indexes)} GPUs; "
                                "set num_gpus to 0 or make them agree.")
    return tuple(indexes), None


def _physical(gpus: tuple[int, ...], cuda_visible: str | None) -> str:
    """The chosen GPUs as CUDA_VISIBLE_DEVICES: relative to what the user already made visible."""
    if cuda_visible:
        physical = [s.strip() for s in cuda_visible.split(",")]
        return ",".join(physical[i] for i in gpus)
    return ",".join(str(i) for i in gpus)
