"""How a run's processes split the training: one value, checked when it is made.

A run of N processes is a grid: `data` groups, each training its own slice of every global batch,
times `context` processes per group that run each sample together (`multi_gpu.context_parallel`:
each takes a part of the sequence). `shard` says over how many processes each trained weight is
split: 1 where every process holds the whole model (one process, DDP), every process under FSDP.
The rank arithmetic - which group a process is in, its place in it, how many slices a batch is cut
into - is done here and nowhere else; the launch spec carries the layout (`LaunchSpec.layout`), the
worker builds its device mesh from it once (`modules/distributed/mesh.py`) and the parallelism reads
it (`modules/trainer/parallelism.py`). A new way to split - pipeline stages, weights offloaded to
host memory - is a new field here, checked with the rest.

Torch-free: the GUI and the launcher make layouts before anything imports PyTorch.
"""
from __future__ import annotations

from dataclasses import dataclass

DATA, RING, ULYSSES = "data", "ring", "ulysses"
"""The device mesh's dimensions: the data groups, then a group's processes as diffusers' context parallelism
names them (ring attention, unused: 1; Ulysses attention: the group's processes)."""


@dataclass(frozen=True)
class ParallelLayout:
    data: int = 1
    """Data-parallel groups: slices of each global batch, one per group."""
    context: int = 1
    """Processes per group, which run each sample together (`multi_gpu.context_parallel`)."""
    shard: int = 1
    """Processes each trained weight is split over: 1 (whole copies: one process, DDP) or all of them (FSDP)."""

    def __post_init__(self) -> None:
        for name, value in (("data", self.data), ("context", self.context), ("shard", self.shard)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel layout: {name} is {value!r}; it counts processes, so a whole number "
                                 "of 1 or more.")
        if self.shard not in (1, self.processes):
            raise ValueError(f"parallel layout: shard {self.shard} over {self.processes} processes; weights are "
                             f"split over every process (multi_gpu.strategy fsdp: shard {self.processes}) or none "
                             "(ddp: shard 1).")

    @classmethod
    def of(cls, processes: int, context: int = 1) -> ParallelLayout:
        """`processes` processes in groups of `context` (whole copies of the model: `sharded` says otherwise)."""
        if context < 1 or processes % context:
            raise ValueError(f"multi_gpu.context_parallel: {context} must divide the number of processes "
                             f"({processes}): each group of {context} trains one slice of the batch; use a divisor "
                             f"of {processes}, or 1.")
        return cls(data=processes // context, context=context)

    def sharded(self, shard: bool) -> ParallelLayout:
        """This layout with the trained weights split over every process (`shard`) or whole on each."""
        return ParallelLayout(self.data, self.context, self.processes if shard else 1)

    @property
    def processes(self) -> int:
        return self.data * self.context

    def data_rank(self, rank: int) -> int:
        """The group of process `rank`: which slice of each global batch it trains (groups are consecutive ranks)."""
        return rank // self.context

    def context_rank(self, rank: int) -> int:
        """The place of process `rank` in its group (0: the one that keeps what the group computed together)."""
        return rank % self.context

    @property
    def loss_scale(self) -> float:
        """Factor on each process's loss so that the gradient exchange's average over all processes is the average
        over the groups: each process of a group gets the gradient of its part of the sequence only, and the
        group's gradients add up to the sample's (`modules/distributed/context_parallel.py`)."""
        return float(self.context)

    @property
    def mesh_dimensions(self) -> dict[str, int]:
        """The device mesh: its dimensions by name and size - the data groups alone, or with context parallelism
        the data groups x a group's processes."""
        return {DATA: self.data} if self.context == 1 else {DATA: self.data, RING: 1, ULYSSES: self.context}

    def describe(self) -> str:
        """"4 processes in 2 groups of 2 (context parallel)", or "2 processes"."""
        said = f"{self.processes} process{'es' if self.processes != 1 else ''}"
        if self.context == 1:
            return said
        return f"{said} in {self.data} group{'s' if self.data != 1 else ''} of {self.context} (context parallel)"
