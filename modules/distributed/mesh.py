"""The run's device mesh, built from its layout (`modules/launch/layout.py`) once, when a strategy first needs it.

Every process group the parallelism uses comes out of this one mesh: FSDP shards over all of its processes
(`shards`), context parallelism exchanges sequence parts inside a group (`context_groups`). DDP needs none of
it (it uses the default process group), so a DDP run without context parallelism never builds it.
"""
from __future__ import annotations

import functools

from modules.launch.layout import RING, ULYSSES, ParallelLayout

SHARDS = "shard"
"""The name of the mesh's dimension over every process (FSDP's), where several dimensions are flattened."""


class LayoutMesh:
    def __init__(self, layout: ParallelLayout, device_type: str) -> None:
        """`layout`: the run's; `device_type`: `cuda` or `cpu` (gloo's CPU processes)."""
        self.layout = layout
        self.device_type = device_type

    @functools.cached_property
    def root(self):
        """The device mesh itself (a collective: every rank builds it, the first time any asks)."""
        from torch.distributed.device_mesh import init_device_mesh

        dimensions = self.layout.mesh_dimensions
        return init_device_mesh(self.device_type, tuple(dimensions.values()), mesh_dim_names=tuple(dimensions))

    def shards(self):
        """The one-dimensional mesh over every process, in rank order (what FSDP shards the trained weights over)."""
        if self.layout.context == 1:
            return self.root  # one dimension already: the data groups are the processes
        return self.root._flatten(SHARDS)

    def context_groups(self):
        """The mesh of this process's group, as diffusers' context parallelism takes it (ring x Ulysses)."""
        if self.layout.context == 1:
            raise ValueError("parallel layout: no context-parallel groups (multi_gpu.context_parallel is 1)")
        return self.root[RING, ULYSSES]
