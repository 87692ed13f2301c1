"""What a process does for the run besides training, by its rank: decided here, once.

Every rank runs the same loop and calls the same methods. Rank 0 also speaks for the run; the other
ranks get stand-ins that do nothing, so the loop never asks which rank it is:

| duty | rank 0 | other ranks |
| --- | --- | --- |
| events (`@tandem` lines for the GUI) | the callbacks given | `TrainingCallbacks()`, silent |
| progress bar, TensorBoard scalars, step log lines | `ProgressReporter(leads=True)` | it only keeps time |
| reading the commands file | yes (`StepExchange` shares what it read) | signals only; with several machines the first process of each reads its machine's file too (`launch.reads_commands`) |
| the clock of timed backups | yes | - |
| the workspace lock of a run no launcher started (a user's torchrun) | takes it | - |
| INFO logging | stdout | warnings and errors on stderr (`util/logs.setup_logging`) |

Files are the one duty that takes every rank: rank 0 writes them through `dist_utils.on_main`, which
tells every rank whether the write worked, so that all leave, or all fail, together.
"""
from __future__ import annotations

from dataclasses import dataclass

from modules.trainer.callbacks import TrainingCallbacks


@dataclass(frozen=True)
class RankDuties:
    callbacks: TrainingCallbacks
    """Where this rank's events go: the run's callbacks on rank 0, a silent stand-in elsewhere."""
    leads: bool
    """Rank 0: shows progress, reads the commands file, keeps the clock of timed backups, takes the workspace lock."""


def rank_duties(rank: int, callbacks: TrainingCallbacks | None) -> RankDuties:
    if rank == 0:
        return RankDuties(callbacks or TrainingCallbacks(), leads=True)
    return RankDuties(TrainingCallbacks(), leads=False)
