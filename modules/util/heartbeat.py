"""Where this rank is, as the training loop says it: the step, the phase, and whether the phase is a long one.

The loop tells its `Heartbeat` at each phase of a step (`at`) and wraps the phases that may take long in
`during` (start-up, compiling, sampling, backups, saving, validation). Saying it costs two assignments.
In one process nobody listens; with several, `modules/distributed/watchdog.py` publishes it through the
rendezvous store and ends the job when a rank stops answering or stops making progress. `failed` is
called with the exception that ends the run, before any clean-up: the clean-up may wait for other ranks
(a collective, the process group's end), and they must learn now that this rank is out.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

PHASE_ORDER = {"loading a batch": 1, "training step": 2, "after the step": 3}
"""The phases of a steady step, in the order a step runs them: a rank whose (step, phase) is behind the
others' is the one they wait for. Other phases (long ones) sort after them."""

FINISHED = "finished"
"""The phase of a rank that ended its run: it may leave at any moment, and is never waited for."""


class Heartbeat:
    """This rank's step and phase, written by the loop and read by a watchdog thread."""

    def __init__(self) -> None:
        self.step = 0
        self.phase = "starting"
        self.long = True
        self.changed_at = time.monotonic()
        self.slowest_phase_s = 0.0
        """The longest phase of a steady step so far (long phases not counted): what a step may take here."""
        self.failure: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self.on_finish: Callable[[], None] | None = None

    def at(self, phase: str, step: int | None = None, long: bool = False) -> None:
        """This rank is now in `phase` (of `step`, when given)."""
        now = time.monotonic()
        if not self.long:
            self.slowest_phase_s = max(self.slowest_phase_s, now - self.changed_at)
        if step is not None:
            self.step = step
        self.phase, self.long, self.changed_at = phase, long, now

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """A long phase for the block (a backup, a sampling, compiling); then the phase before it again."""
        before = (self.phase, self.long)
        self.at(phase, long=True)
        try:
            yield
        finally:
            self.at(before[0], long=before[1])

    def failed(self, error: BaseException) -> None:
        """The run ends with `error` on this rank (called before its clean-up; the first call counts)."""
        if self.failure is not None:
            return
        self.failure = error
        if self.on_failure is not None:
            self.on_failure(error)

    def finished(self) -> None:
        """The run ended here as it should: this rank may leave, nobody waits for it."""
        self.at(FINISHED, long=True)
        if self.on_finish is not None:
            self.on_finish()

    @property
    def position(self) -> tuple[int, int]:
        """(step, order of the phase): compared between ranks to find the one behind."""
        return self.step, PHASE_ORDER.get(self.phase, len(PHASE_ORDER) + 1)
