"""The derived numbers of a run (global batch, steps, scaled LRs), computed once and printed at start."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from modules.config import TrainConfig
from modules.launch.layout import ParallelLayout
from modules.launch.spec import LaunchSpec


@dataclass(frozen=True)
class RunNumbers:
    world_size: int
    """Slices of each global batch: the processes, or their context-parallel groups (`multi_gpu.context_parallel`)."""
    per_gpu_batch: int
    accumulation: int
    global_batch: int
    micro_batches_per_epoch: int
    steps_per_epoch: int
    epochs: int
    total_steps: int
    base_lr: float
    lr_scaling: str
    lr: float
    """The denoiser's learning rate as the optimizer starts it: the launch's, scaled once (`LaunchSpec`)."""
    split: tuple[int, ...] = ()
    """Samples each rank trains per micro-batch when they differ (`multi_gpu.batch_split`); empty when equal."""
    items_per_epoch: int | None = None
    """Dataset items (images x repeats); None when the caller did not say."""
    items_left_out: int | None = None
    """Items no step of an epoch trains on (bucket remainders, and micro-batches short of a full
    accumulation); other items each epoch, as the sampler reshuffles."""
    processes: int = 0
    """Processes that train: `world_size` x the context-parallel group size (0: `world_size`)."""
    context: int = 1
    """Processes per group, which run each sample together (`multi_gpu.context_parallel`)."""
    text_encoder_lr: float | None = None
    """The text encoders' learning rate as the optimizer starts it (scaled as `lr`); None: `lr`."""
    lr_factor: float = 1.0
    """What the LR scaling multiplied each learning rate by (the launch's)."""

    def group_lrs(self, text_encoders: bool) -> list[float]:
        """The learning rate of each optimizer group: the denoiser's, and the text encoders' when they train."""
        return [self.lr, self.text_encoder_lr or self.lr] if text_encoders else [self.lr]

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        scale = "" if self.lr_scaling == "none" else f" ({self.lr_scaling} scaling x{self.lr_factor:.3g})"
        per_gpu = (f"per-GPU batch {' + '.join(map(str, self.split))} x accumulation {self.accumulation}"
                   if self.split else
                   f"per-{self._unit()} batch {self.per_gpu_batch} x accumulation {self.accumulation} x "
                   f"{self.world_size}")
        return (f"{self._processes()} | {per_gpu} = global batch {self.global_batch} | "
                f"{self.steps_per_epoch} steps/epoch x {self.epochs} epochs = {self.total_steps} steps | "
                f"{self._items()}LR {self.base_lr:g} -> {self.lr:g}{scale}")

    def _processes(self) -> str:
        """How many processes train and, with context parallelism, in how many groups: the global batch is cut
        into one slice per group, so "world size" alone would read 1 for 4 processes in one group."""
        return ParallelLayout(self.world_size, self.context).describe()

    def _unit(self) -> str:
        return "GPU" if self.context == 1 else "group"

    def _items(self) -> str:
        if self.items_per_epoch is None:
            return ""
        return f"{self.items_per_epoch} items/epoch, {self.items_left_out} left out per epoch | "


def derive_run_numbers(cfg: TrainConfig, world_size: int, micro_batches_per_epoch: int,
                       split: list[int] | None = None, items_per_epoch: int | None = None,
                       launch: LaunchSpec | None = None) -> RunNumbers:
    """`micro_batches_per_epoch` counts global micro-batches (each = per-GPU batch x world size); `split`:
    the per-rank sizes when they differ (their sum is still per-GPU batch x world size);
    `items_per_epoch` (the dataset's length) adds how many items each epoch leaves out. The global batch and
    the scaled LR are the launch's (`launch`; when not given, those of a launch of `world_size` processes
    with `cfg`): a round on fewer processes keeps both."""
    t = cfg.training
    if launch is None:
        launch = LaunchSpec(launcher="single" if world_size == 1 else "external", world_size=world_size,
                            device_type="cpu", gpus=(), visible_devices=None, backend="", per_gpu_batch=t.batch_size,
                            accumulation=t.gradient_accumulation_steps, base_lr=t.learning_rate,
                            text_encoder_base_lr=t.text_encoder_learning_rate or None,
                            lr_scaling=cfg.multi_gpu.lr_scaling)
    accumulation = t.gradient_accumulation_steps
    global_batch = launch.global_batch
    if global_batch != t.batch_size * accumulation * world_size:
        raise ValueError(f"the launch's global batch of {global_batch} is not training.batch_size {t.batch_size} x "
                         f"accumulation {accumulation} x {world_size} processes (a round on fewer processes must "
                         "raise the accumulation to keep it)")
    steps_per_epoch = micro_batches_per_epoch // accumulation
    if steps_per_epoch < 1:
        raise ValueError(
            f"the data gives {micro_batches_per_epoch} batch(es) of {t.batch_size * world_size} images per epoch, "
            f"fewer than training.gradient_accumulation_steps={accumulation}: lower the accumulation or the batch "
            f"size, use fewer GPUs, or add images/repeats.")
    if t.max_steps > 0:
        total = t.max_steps
        epochs = math.ceil(total / steps_per_epoch)
    else:
        epochs = t.epochs
        total = steps_per_epoch * epochs
    left_out = None if items_per_epoch is None else items_per_epoch - steps_per_epoch * global_batch
    return RunNumbers(world_size=world_size, per_gpu_batch=t.batch_size, accumulation=accumulation,
                      global_batch=global_batch,
                      micro_batches_per_epoch=micro_batches_per_epoch, steps_per_epoch=steps_per_epoch,
                      epochs=epochs, total_steps=total, base_lr=launch.base_lr, lr_scaling=launch.lr_scaling,
                      lr=launch.lr, text_encoder_lr=launch.text_encoder_lr, lr_factor=launch.lr_factor,
                      split=tuple(split) if split and len(set(split)) > 1 else (),
                      items_per_epoch=items_per_epoch, items_left_out=left_out,
                      processes=launch.layout.processes, context=launch.layout.context)
