"""Where the wait before the first step goes: the start-up's phases, their parts, and the first step.

Everything before the first step is time a user waits through, and most of it does not shrink with more
GPUs, so every start says where it went: `Start-up: launch X s, set-up X s, data scan X s, model X s,
cache X s, wrap X s, resume X s` and, where a phase's parts are known, `Start-up parts: ...` (the
launch: the launcher's imports and checks, starting the workers and their imports, from
`util/launch_clock.py`; set-up: waiting for the last rank, the process group, the strategy). Then the
first step, which starts the loader's workers and selects kernels, reports its own parts (`first_step`).
"""
from __future__ import annotations

import faulthandler
import logging
import time

import torch

from modules.trainer.progress import PhaseTimes
from modules.util.launch_clock import launch_split

log = logging.getLogger("tandem")


class StartupTimes(PhaseTimes):
    """The start-up's phases (`time(name)` around each), with the launch before them, and the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.over_at: float | None = None
        """When the start-up summary was given (`perf_counter`): what ran between it and the first step is
        start-up time too."""
        self.first_step_done = False

    def launched(self, now: float) -> None:
        """Count the launch: from the user's command to this trainer's start at `now` (seconds since the
        epoch), when the launcher said when it began (processes starting, libraries importing, its checks)."""
        launched, parts = launch_split(now)
        if launched is not None:
            self.seconds["launch"] = launched
            self.parts["launch"] = parts

    def summarise(self) -> None:
        """Log where the start-up went."""
        log.info("Start-up: %s", self.describe())
        parts = self.describe_parts()
        if parts:
            log.info("Start-up parts: %s", parts)

    def over(self) -> None:
        """The start-up is over; the loop begins."""
        self.over_at = time.perf_counter()

    def first_step(self, device: torch.device, started: float, loaded: float, workers_s: float) -> None:
        """Log where the first step's time went - the loader's workers starting (`workers_s`), its first batch
        (`started` to `loaded`), kernel selection and first allocations in the step - and what ran between the
        start-up summary and it (spawned ranks whose loader spawned its workers took ~10 s there on H100
        hosts). Waits for the device: the one synchronisation the loop makes."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        done = time.perf_counter()
        faulthandler.cancel_dump_traceback_later()
        self.first_step_done = True
        log.info("First step: %.1f s (first batch from the loader %.1f s, the step itself %.1f s); %.1f s before it "
                 "since the start-up summary (starting the loader's workers %.1f s).",
                 done - started, loaded - started, done - loaded, started - self.over_at, workers_s)
