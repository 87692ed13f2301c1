"""Stopping a run whose numbers stopped being finite, before anything is written from them.

The loss of each finished step is checked as its report arrives (one step late: the loop does not wait
for the GPU), and the trained weights before any output is written from them (samples, backups, the
model): a run whose loss turned NaN stops and saves nothing, and says which backup is the newest good
one. fp16 loss scaling skips a step whose values overflowed - the weights stay unchanged, so a few in a
row are normal; more are a failure.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Callable

import torch

from modules.util import dist_utils as du

log = logging.getLogger("tandem")

FP16_SKIPS_TOLERATED = 10
"""fp16 loss scaling skips a step whose values overflowed (weights unchanged); this many in a row is a failure."""


class NonFiniteTrainingError(RuntimeError):
    """The loss or the trained weights stopped being finite numbers: the run cannot continue."""


class FiniteGuard:
    def __init__(self, precision: str, learning_rate: float, last_backup: Callable[[], Path | None]) -> None:
        """`precision`: `training.precision`; `learning_rate`: `training.learning_rate` (named in the advice);
        `last_backup()`: the run's newest backup, if any, for the message."""
        self.precision = precision
        self.learning_rate = learning_rate
        self.last_backup = last_backup
        self.in_a_row = 0

    def check_loss(self, step: int, loss: float) -> None:
        """Stop at the first non-finite loss; with fp16 loss scaling, skipped steps are normal unless they persist."""
        if math.isfinite(loss):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.precision == "fp16" and self.in_a_row < FP16_SKIPS_TOLERATED:
            log.warning("Step %d: the loss overflowed in fp16; loss scaling skips this step.", step)
            return
        self.fail(f"the loss of step {step} is {loss}")

    def check_weights(self, params: list[torch.nn.Parameter], step: int) -> None:
        """Every trained weight must be a finite number (on every rank's shard: all ranks answer alike)."""
        if params and not du.all_finite(params):
            self.fail(f"the trained weights hold NaN or infinite values after step {step}")

    def fail(self, what: str) -> None:
        last = self.last_backup()
        kept = f"the newest good backup is {last}" if last else "no backup of this run was written before it"
        raise NonFiniteTrainingError(
            f"Training stopped: {what}. Nothing was saved as the final model ({kept}). Lower "
            f"training.learning_rate (now {self.learning_rate:g}), keep training.max_grad_norm on, "
            "or train in bf16 instead of fp16.")
