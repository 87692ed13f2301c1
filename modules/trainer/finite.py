"""Stopping a run whose numbers stopped being finite, before anything is written from them.

The loss of each finished step is checked as its report arrives (one step late: the loop does not wait
for the GPU), and the trained weights before any output is written from them (samples, backups, the
model): a run whose loss turned NaN stops, saves nothing, and says which of its backups hold sound
weights. fp16 loss scaling skips a step whose values overflowed - the weights stay unchanged, so a few
in a row are normal; more are a failure.

A backup's weights are known sound only when the next step's loss, computed from them, was finite: a huge
learning rate gives finite but absurd weights first (1e29 after one step of 1e30), and only the loss after
them shows it. So the guard remembers the last step whose loss was finite, and the backups at or after it
are named as the ones not to continue.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from modules.util import dist_utils as du

log = logging.getLogger("tandem")

FP16_SKIPS_TOLERATED = 10
"""fp16 loss scaling skips a step whose values overflowed (weights unchanged); this many in a row is a failure."""


class NonFiniteTrainingError(RuntimeError):
    """The loss or the trained weights stopped being finite numbers: the run cannot continue."""


class FiniteGuard:
    def __init__(self, precision: str, learning_rate: float) -> None:
        """`precision`: `training.precision`; `learning_rate`: `training.learning_rate` (named in the advice)."""
        self.precision = precision
        self.learning_rate = learning_rate
        self.in_a_row = 0
        self.last_finite_loss_step = 0
        """The last step whose loss was finite: the weights before it were sound."""
        self.written_backups: Callable[[], list] | None = None
        """Rank 0's list of this run's backups (`backup.BackupInfo`, oldest first) once none is being written;
        set once the run's outputs exist (`watch_backups`)."""

    def watch_backups(self, written_backups: Callable[[], list]) -> None:
        """From now on a failure names the run's backups that hold sound weights (`written_backups()`, called
        on rank 0 alone)."""
        self.written_backups = written_backups

    def check_loss(self, step: int, loss: float) -> None:
        """Stop at the first non-finite loss; with fp16 loss scaling, skipped steps are normal unless they persist."""
        if math.isfinite(loss):
            self.in_a_row = 0
            self.last_finite_loss_step = max(self.last_finite_loss_step, step)
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
        """Stop the run (every rank calls this at the same step) with one statement on every rank: which
        backups of this run hold weights known to be sound (rank 0's word, shared)."""
        listed = self.written_backups
        kept = du.broadcast_object(du.on_main(lambda: sound_backups(listed(), self.last_finite_loss_step))
                                   if listed is not None else None)
        kept = kept or "no backup of this run was written before it"
        raise NonFiniteTrainingError(
            f"Training stopped: {what}. Nothing was saved as the final model ({kept}). Lower "
            f"training.learning_rate (now {self.learning_rate:g}), keep training.max_grad_norm on, "
            "or train in bf16 instead of fp16.")


def sound_backups(written: list, last_finite_loss_step: int) -> str | None:
    """What to say of the backups `written` (oldest first) once the values stopped being finite: the newest
    whose weights are sound (written before the last step with a finite loss), and those that hold the
    weights that led to the failure. None when there are none."""
    sound = [b for b in written if b.step < last_finite_loss_step]
    unsound = [b.step for b in written if b.step >= last_finite_loss_step]
    text = f"the newest backup with sound weights is {sound[-1].path}" if sound else None
    if unsound:
        steps = ", ".join(map(str, unsound))
        text = (f"{text + '; ' if text else 'no backup of this run has sound weights: '}the backup(s) at step(s) "
                f"{steps} hold the weights that led to it - do not continue them")
    return text
