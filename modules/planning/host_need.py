"""The host memory (RAM) a memory plan needs on one machine, before anything loads: what the plan checks beside
the GPUs' memory (`memory_plan.choose_plan` with a `HostRoom`).

Counted for the machine's training processes, from the same sizes as the GPU estimate (`memory_need.py`):
- layer offload's copy of the swapped blocks: once - the ranks of a machine share it
  (`modules/model/shared_host_copy.py`);
- FSDP's CPU offload: every rank its shards, with their gradients and optimizer state;
- activation offloading: every rank its micro-batch's checkpointed block inputs, in pinned memory;
- Wan 2.2 A14B's frozen expert: every rank's;
- the VAE and frozen text encoders that wait in host memory once their outputs are cached: once - they are
  read in the dtype of their files through the page cache, which the ranks share (a family whose text encoder
  is loaded apart, Qwen-Image or Z-Image, frees it after encoding);
- the backup's snapshot of the trained weights, optimizer state and EMA: once (rank 0's, or each rank's part
  under FSDP);
- `PROCESS_HOST_GIB` for each process: Python, PyTorch, the CUDA runtime's host side, the data loading.

The weights are loaded through the page cache too (a file's pages, shared by the ranks and given back under
pressure), so loading adds little where they are kept in the dtype of their files; an fp8 base is converted on
each rank, its float8 copy counted in the plan's weights. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from modules.planning.memory_need import (DTYPE_BYTES, GIB, Facts, Need, Setup, frozen_expert_bytes,
                                        offloaded_activation_bytes, optimizer_state_bytes, swapped_bytes, text_cached)
from modules.families.registry import FAMILIES

PROCESS_HOST_GIB = 2.0
"""Host memory of one training process beside the model: the interpreter and PyTorch, the CUDA runtime's host
side, pinned staging buffers, the data loader (a round figure)."""
HOST_SAFETY_FRACTION = 0.9
"""Share of the machine's available memory a plan may fill: the page cache and the rest of the system need room."""


@dataclass(frozen=True)
class HostRoom:
    """The host memory a plan may use on the machine, and how many training processes share it."""
    gib: float
    source: str
    """Where the figure comes from: `MemAvailable` of /proc/meminfo, or `--plan-for 1x24:64`."""
    processes: int


@dataclass
class HostNeed:
    """GiB of host memory one machine needs for a plan, by part."""
    parts: dict[str, float]
    processes: int

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def host_need(f: Facts, cfg, setup: Setup, rank_need: Need, processes: int, batch: int | None = None) -> HostNeed:
    """The host memory of `processes` ranks of one machine training `cfg` as `setup` (`rank_need`: one rank's GPU
    estimate, whose `host` is what it offloads; `batch`: the largest micro-batch of a rank, the config's when None)."""
    t, m = cfg.training, cfg.model
    lora = t.method == "lora"
    swapped = swapped_bytes(f, "fp8" if setup.fp8 else m.unet_dtype, setup.offload_blocks)[0] \
        if lora and setup.offload_blocks > 0 else 0
    expert = frozen_expert_bytes(f, cfg)
    offloaded = max(0.0, rank_need.host * GIB - swapped - expert)  # FSDP's CPU offload: this rank's shards
    frozen_encoders = [n for n in f.sizes.text_encoders() if n not in f.trained_encoders]
    apart = f.sizes.family in FAMILIES and FAMILIES[f.sizes.family].text_apart
    encoders = 0 if apart or not text_cached(cfg) else \
        sum(f.params[n] for n in frozen_encoders) * DTYPE_BYTES.get(m.text_encoder_dtype, 2)
    vae = f.params.get("vae", 0) * DTYPE_BYTES.get(m.vae_dtype, 2) if cfg.data.cache_latents else 0
    optimizer = optimizer_state_bytes(cfg.optimizer.name, f.trainable_shapes, cfg.optimizer.momentum,
                                      cfg.optimizer.prodigy_slice_p)
    backup = 4 * f.trainable * (2 if t.ema else 1) + optimizer
    activations = offloaded_activation_bytes(f, cfg, setup, t.batch_size if batch is None else batch)
    parts = {
        "layer offload's copy (one per machine)": swapped / GIB,
        "CPU offload of the shards": processes * offloaded / GIB,
        "offloaded activations": processes * activations / GIB,
        "frozen expert": processes * expert / GIB,
        "VAE and text encoders after caching": (encoders + vae) / GIB,
        "backup snapshot": backup / GIB,
        "processes": processes * PROCESS_HOST_GIB,
    }
    return HostNeed({k: v for k, v in parts.items() if v > 0.005}, processes)


def available_gib() -> float | None:
    """This machine's `MemAvailable` in GiB (what can be had without swapping); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError, IndexError):
        pass
    return None


def this_machine(processes: int, in_use_gib: float = 0.0) -> HostRoom | None:
    """The host room of this machine for `processes` training processes; None where unknown. `in_use_gib`: what
    those processes hold already (planning inside them: `PROCESS_HOST_GIB` counts it)."""
    gib = available_gib()
    return None if gib is None else HostRoom(gib + in_use_gib, "MemAvailable", processes)


def fits(need: HostNeed, room: HostRoom | None) -> bool:
    return room is None or need.total <= room.gib * HOST_SAFETY_FRACTION
