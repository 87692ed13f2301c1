"""Progress, loss and throughput reporting: tqdm in a terminal, events for the GUI, TensorBoard."""
from __future__ import annotations

import contextlib
import logging
import sys
import time

from modules.distributed import dist_utils as du

log = logging.getLogger("tandem")


class PhaseTimes:
    """Seconds spent in each named phase, in order (start-up: where the wait before step 1 goes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def describe(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())


class ProgressReporter:
    def __init__(self, trainer) -> None:
        self.t = trainer
        self.main = du.is_main()
        self.start_step = trainer.global_step
        self.start_time = time.perf_counter()
        self.last_time = self.start_time
        self.last_log = 0.0
        self.step_s: float | None = None
        self.images_per_s = 0.0
        self.bar = None
        self.writer = None
        if self.main:
            if sys.stderr.isatty():
                from tqdm import tqdm
                self.bar = tqdm(total=trainer.numbers.total_steps, initial=trainer.global_step, unit="step",
                                dynamic_ncols=True)
            if trainer.cfg.general.tensorboard:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(str(trainer.paths.tensorboard))

    def step(self, report) -> None:
        """Report a finished step (the loop is one step further by now; see step_exchange)."""
        t = self.t
        step, loss_mean, lr = report.step, report.loss, report.lr
        now = time.perf_counter()
        dt = now - self.last_time
        self.last_time = now
        # The step time is smoothed, not the rate: a report that arrives right after the one before
        # it (the GPU had already finished, e.g. after a save synchronised it) would otherwise add an
        # absurd rate. The first step (warm-up: kernel autotuning, first allocations) is left out.
        if step > self.start_step + 1:
            self.step_s = dt if self.step_s is None else 0.9 * self.step_s + 0.1 * dt
            self.images_per_s = t.numbers.global_batch / self.step_s if self.step_s > 0 else 0.0
        if not self.main:
            return
        left = t.numbers.total_steps - step
        eta = left * t.numbers.global_batch / self.images_per_s if self.images_per_s > 0 else None
        t.emit("loss", step=step, loss=loss_mean, lr=lr)
        t.emit("progress", epoch=report.epoch + 1, epochs=t.numbers.epochs, step=step,
               total_steps=t.numbers.total_steps, images_per_s=round(self.images_per_s, 3),
               eta_s=round(eta, 1) if eta is not None else None)
        if self.writer is not None:
            self.writer.add_scalar("loss", loss_mean, step)
            self.writer.add_scalar("lr", lr, step)
            self.writer.add_scalar("images_per_s", self.images_per_s, step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss_mean:.4f}", img_s=f"{self.images_per_s:.1f}", epoch=report.epoch + 1)
        elif now - self.last_log > 10 or step == t.numbers.total_steps:
            self.last_log = now
            log.info("step %d/%d epoch %d loss %.4f %.2f img/s", step, t.numbers.total_steps,
                     report.epoch + 1, loss_mean, self.images_per_s)

    def log_image(self, tag: str, image, step: int) -> None:
        if self.writer is not None:
            import numpy as np
            self.writer.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
