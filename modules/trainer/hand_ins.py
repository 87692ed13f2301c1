"""What a caller hands a trainer to vary one run without subclassing it.

The trainer runs its own code path - set-up, the loop, the step, the end - and asks the hand-ins only where a
caller may differ: where the data and the model come from (`RunSource`), who is told where the loop is
(`StepObserver`) and whether the end writes the run's outputs. A user's run takes the defaults; the benchmark
(`modules/benchmark/runner.py`) hands in synthetic cached data, a random real-size model and a step timer, so
what it measures is the trainer users run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class RunSource:
    """Where a run's data and model come from. The default hands in nothing: the trainer scans the config's
    concepts and loads its model."""

    ready_made = False
    """Whether the dataset's items already carry their latents and text embeddings: then nothing is cached or
    encoded before the steps."""

    def dataset(self, trainer) -> Any | None:
        """The training dataset, or None for the config's concepts."""
        return None

    def model(self, trainer) -> Any | None:
        """The `ModelBundle` to train, or None to load the config's model as a user's run loads it."""
        return None


class StepObserver:
    """Told where the loop is, on every rank; the default is told and does nothing. Called on the loop's thread:
    what it does between the calls counts in the run's time."""

    def started(self, trainer) -> None:
        """Set-up is over: the model is wrapped, the optimizer made, a backup resumed; the first step is next."""

    def step_begins(self, trainer) -> None:
        """The step's micro-batches are loaded; its forward, backward and update are queued next."""

    def step_queued(self, trainer) -> None:
        """The step's work is queued (on a GPU it may still run); `trainer.global_step` is not counted up yet."""

    def step_ended(self, trainer) -> None:
        """The step `trainer.global_step` is counted and its after-step work (reports, commands, outputs) done."""

    def ended(self, trainer) -> None:
        """The run's end: after its outputs (if any) and its `done` event, before the ranks' last barrier, so the
        observer may still gather from every rank."""


@dataclass(frozen=True)
class HandIns:
    """Everything a caller hands `BaseTrainer` (its `hand_ins` argument); the defaults are a user's run."""

    source: RunSource = field(default_factory=RunSource)
    observer: StepObserver = field(default_factory=StepObserver)
    final_outputs: bool = True
    """Whether the end writes what a finished or stopped run leaves: the final model and samples, the backup of
    a stop, the note that the run's backups are finished. False: the end writes nothing (a measurement)."""
