"""The validation loss: the held-out images' mean loss, the same on 1 and N processes.

The held-out set (validation concepts and `data.validation_fraction`, `modules/data/roles.py`) is scored with
everything random fixed per image: the noise and timestep come from a generator keyed by (seed, image) alone
and the VAE sample of a cached latent distribution is that of epoch 0, so the curve moves only when the
weights do. Each image is scored alone - batch-mates change a kernel's rounding, and a batch size tied to
training.batch_size would change with the number of GPUs in a 1 x 2B against 2 x B comparison - and the
images go to the ranks in turn; a forward pass without gradients per image is quick beside the training
steps for the few dozen images a validation set holds. Each rank writes its images' losses into its slots
of one float64 vector of every image (zeros elsewhere), one all-reduce adds the vectors - adding zeros is
exact - and every rank sums the slots exactly (`math.fsum`): the mean is bitwise the same on 1 and N
processes (of one device type and, on CPUs, thread count), not an average of averages. Where each
forward gathers weights from every rank (sharded training, FSDP), every rank runs as many: one with fewer
images scores one of its batches again and drops the result (`Parallelism.extra_calls`).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from modules.trainer.controls import control_latents
from modules.trainer.parallelism import Parallelism, SingleProcess
from modules.util import dist_utils as du
from modules.util.batch_slice import BatchSlice

EVALUATION_BATCH = 1
"""Images per forward pass: one, so that an image's loss never depends on its batch-mates (see above)."""
VALIDATION_KEY = -1
"""Draws are keyed like training's (seed, step, micro) with step = VALIDATION_KEY - image: never a training step."""


def evaluation_batches(buckets: list[int], batch_size: int) -> list[list[int]]:
    """Item indexes cut into batches: items of one bucket together, in order, `batch_size` at a time."""
    groups: dict[int, list[int]] = {}
    for index, bucket in enumerate(buckets):
        groups.setdefault(bucket, []).append(index)
    return [group[i:i + batch_size] for group in groups.values() for i in range(0, len(group), batch_size)]


@dataclass(frozen=True)
class Scoring:
    """What scoring held-out images takes of the run besides the model, fixed once the model is wrapped."""
    bundle: Any
    """The `ModelBundle` (its denoiser and text encoders are put in eval mode while scoring; the VAE encodes
    images that are not cached)."""
    objective: Any
    """The family's `Objective`: draws, noisy latents, targets, per-sample losses."""
    device: torch.device
    offset_noise: float
    """`training.offset_noise`, as training draws its noise."""
    autocast: Callable[[], ContextManager]
    """The training autocast."""
    optimizer: Any
    """Schedule-free AdamW's averaged weights are the ones scored (`optim.evaluation_weights`)."""


class ValidationLoss:
    """Scores the held-out `dataset` (a `TrainDataset` without augmentation, cached like the training data)."""

    def __init__(self, dataset, seed: int, scoring: Scoring, parallelism: Parallelism | None = None) -> None:
        """`parallelism`: the run's; where each forward is a collective, a rank with fewer images scores one of
        its batches again and drops it, so that every rank runs the model as often."""
        self.dataset = dataset
        self.seed = seed
        self.scoring = scoring
        batches = evaluation_batches(dataset.buckets, EVALUATION_BATCH)
        parallelism = parallelism or SingleProcess()
        # A context-parallel group scores its batches together; only its first process's losses count.
        self.my_batches = batches[parallelism.data_rank::parallelism.data_world]
        self.keeps_losses = parallelism.context_rank == 0
        extra = parallelism.extra_calls(len(self.my_batches), len(batches))
        self.extra_batches = [batches[0]] * extra if batches else []
        self.last_step: int | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def per_image(self, model: nn.Module) -> torch.Tensor:
        """float64 [images]: this rank's images' losses in their slots, 0 in the others'."""
        from modules.data import collate
        device = self.scoring.device
        losses = torch.zeros(len(self.dataset), dtype=torch.float64, device=device)
        for batch_items in self.my_batches:
            batch = collate([self.dataset[(0, index)] for index in batch_items])
            scored = self.batch_losses(model, batch).double()
            if self.keeps_losses:
                losses[batch["indices"].to(device)] = scored
        for batch_items in self.extra_batches:  # only for the collectives of a sharded forward; dropped
            self.batch_losses(model, collate([self.dataset[(0, index)] for index in batch_items]))
        return losses

    def batch_losses(self, model: nn.Module, batch: dict) -> torch.Tensor:
        scoring = self.scoring
        dev, objective = scoring.device, scoring.objective
        if "latents" in batch:
            latents = batch["latents"].to(dev).float()
        else:
            latents = scoring.bundle.encode_images(batch["pixels"].to(dev)).float()
        text = batch.get("text")
        if text is not None:
            text = {k: v.to(dev) for k, v in text.items()}
        draws = [objective.draw((1, *latents.shape[1:]), self.seed, VALIDATION_KEY - int(index), 0,
                                BatchSlice(0, 1, 1), dev, scoring.offset_noise)
                 for index in batch["indices"]]
        draw = type(draws[0])(torch.cat([d.noise for d in draws]), torch.cat([d.timesteps for d in draws]))
        with scoring.autocast():
            pred = model(objective.noisy(latents, draw), draw.timesteps, text, batch.get("captions"),
                         batch.get("original_sizes"), batch.get("crop_coords"), batch.get("target_sizes"),
                         controls=control_latents(scoring.bundle, batch, dev))
        masks = batch.get("masks")
        return objective.per_sample_loss(pred, objective.target(latents, draw), draw,
                                         None if masks is None else masks.to(dev))

    def evaluate(self, model: nn.Module, step: int) -> float:
        """The mean loss over every held-out image of `model` (the trained module itself, whose forward
        synchronises no gradients) at `step`; every rank must call it at the same step."""
        from modules.trainer.optim import evaluation_weights
        bundle = self.scoring.bundle
        denoiser = bundle.denoiser
        encoders = [(te, te.training) for te in bundle.text_encoders]
        denoiser.eval()  # no LoRA dropout: the same weights give the same loss
        for te, _ in encoders:
            te.eval()
        # training.compile: the uncompiled denoiser, whose one-image shapes need no compiling (and no check).
        eager = model.eager_unet() if hasattr(model, "eager_unet") else contextlib.nullcontext()
        try:
            with torch.no_grad(), evaluation_weights(self.scoring.optimizer), eager:
                losses = self.per_image(model)
        finally:
            denoiser.train()
            for te, was_training in encoders:
                te.train(was_training)
        losses = du.all_reduce_sum_tensor(losses)
        self.last_step = step
        # fsum is exactly rounded: the same slots give the same mean whatever device or order sums them.
        return math.fsum(losses.cpu().tolist()) / len(self.dataset)
