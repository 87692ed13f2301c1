"""Context parallelism (`multi_gpu.context_parallel = C`): each sample's token sequence split over C processes.

The processes form groups of C consecutive ranks (ranks 0..C-1 the first group, C..2C-1 the next); a
group trains one slice of each global batch together: the run's layout (`ParallelLayout`) says which
slice a process trains and how many there are (the sampler, the batch slice and the noise draw read
those through the parallelism's `data_rank` and `data_world`). Inside a group the denoiser runs with
diffusers' own context parallelism: its `_cp_plan` splits the token sequence after the patch
embedding, self-attention runs as
Ulysses attention (an all-to-all swaps the sequence split for a split of the heads, so each process
attends over the whole sequence for its heads), cross-attention to the text stays local, and the output
is gathered before the loss. Every process of a group so computes the same loss, and the gradient each
process gets covers its part of the sequence only: their sum over the group is the sample's gradient.

The gradient exchange of the strategy (DDP's all-reduce, FSDP's reduce-scatter) averages over all
`world` processes, i.e. (1/C) x the average over the groups of each group's summed gradient. The loss
of every process is therefore scaled by C (`ParallelLayout.loss_scale`): the exchange then yields
exactly the average over the groups, as N / C processes without context parallelism would - the same
training (CPU tests: tests/unit/test_context_parallel.py). C must divide the attention heads and each sample's tokens (`indivisible`).

Why diffusers' and not PyTorch's `context_parallel`: PyTorch's experimental API shards the buffers of
`scaled_dot_product_attention` calls inside a context manager and needs every sequence-shaped tensor
(rotary tables, masks) registered by hand per model; diffusers' plans already say, per transformer
class, where to split and gather, and its attention dispatcher does the all-to-all.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from modules.config.validation import context_parallel_family_problem

log = logging.getLogger("tandem")


class ContextParallel:
    """Each sample's sequence split over the processes of its group: what a parallelism whose layout has groups of
    several processes holds (`Parallelism.sequences`). The rest of what groups change - which slice of the batch a
    process trains, the loss scale, who keeps a group's results - the layout says (`ParallelLayout`)."""

    def __init__(self, mesh) -> None:
        """`mesh`: the run's `LayoutMesh` (`mesh.py`), whose layout has groups of more than one process."""
        self.mesh = mesh
        self.layout = mesh.layout

    def split(self, bundle, device: torch.device, sizes: list[tuple[int, int]]) -> None:
        """Turn on the denoiser's context parallelism over this process's group (collective: every rank);
        `sizes`: the (width, height) of every bucket the run trains or scores."""
        degree, family = self.layout.context, bundle.family
        # A model found by `auto`: validation could not know its family.
        problem = context_parallel_family_problem(degree, family.name) or indivisible(
            degree, bundle.denoiser.config.get("num_attention_heads", 0), sizes,
            family.sample_size_multiple(bundle))  # pixels per token side (Wan 2.2 TI2V 5B: 32)
        if problem:
            raise ValueError(problem)
        split_over_groups(bundle.denoiser, self.mesh, device)
        log.info("Context parallelism: each sample's sequence split over %d processes (Ulysses attention); "
                 "%d group(s) train their share of each batch.", degree, self.layout.data)


def indivisible(degree: int, heads: int, sizes: list[tuple[int, int]], pixels_per_token: int) -> str | None:
    """Why Ulysses attention over `degree` processes cannot take this model or these buckets (None: it can).

    Its all-to-all swaps equal parts of the sequence for equal groups of heads, so both must divide; diffusers'
    mode for uneven parts has no backward. A clip's tokens are its latent frames x an image's of its size, so
    checking each bucket's image tokens covers clips too."""
    field = f"multi_gpu.context_parallel: {degree}"
    if heads % degree:
        fits = [d for d in range(2, heads + 1) if heads % d == 0 and d <= 8]
        return (f"{field} must divide the transformer's {heads} attention heads (Ulysses attention gives each process "
                f"an equal share of them); use {' or '.join(map(str, fits)) or 1}.")
    for width, height in sorted(set(sizes)):
        tokens = (width // pixels_per_token) * (height // pixels_per_token)
        if tokens % degree:
            return (f"{field} must divide every sample's tokens, but a {width}x{height} bucket has {tokens} per frame "
                    f"({width // pixels_per_token} x {height // pixels_per_token}: a token per {pixels_per_token} px); "
                    f"use sides that are multiples of {pixels_per_token * 2} (data.resolution, data.bucket_step), or "
                    "another context_parallel.")
    return None


def split_over_groups(denoiser: torch.nn.Module, mesh, device: torch.device) -> None:
    """diffusers' context parallelism on `denoiser`, over the groups of consecutive ranks of `mesh` (`LayoutMesh`)."""
    from diffusers import ContextParallelConfig

    if getattr(type(denoiser), "_cp_plan", None) is None:
        raise ValueError(f"multi_gpu.context_parallel: {type(denoiser).__name__} has no context-parallel plan in "
                         "diffusers; set multi_gpu.context_parallel to 1.")
    config = ContextParallelConfig(ulysses_degree=mesh.layout.context, mesh=mesh.context_groups())
    with _quiet_experimental_warning(), _cpu_counts_as_one_device(device):
        denoiser.enable_parallelism(config=config)


@contextlib.contextmanager
def _cpu_counts_as_one_device(device: torch.device):
    """diffusers records the device of a rank as `rank % torch.accelerator.device_count()`, which divides by zero
    in a process without an accelerator; its context parallelism never uses that device (the mesh is given).
    CPU processes (the tests, gloo) count as one device while it is recorded."""
    if device.type != "cpu" or torch.accelerator.device_count() > 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


@contextlib.contextmanager
def _quiet_experimental_warning():
    """`enable_parallelism` warns on every rank that it is experimental (Tandem's tests pin what it does), and its
    hooks once per process that a timestep of one value per sample is not split (as intended: it is not a sequence)."""
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.get_logger("diffusers.hooks.context_parallel").setLevel(logging.ERROR)
    logger = diffusers_logging.get_logger("diffusers.models.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
