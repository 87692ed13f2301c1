"""Progress, loss and throughput reporting: tqdm in a terminal, events for the GUI, TensorBoard."""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Callable

from modules.trainer.run_numbers import RunNumbers
from modules.util.durations import format_seconds

log = logging.getLogger("tandem")


class PhaseTimes:
    """Seconds spent in each named phase, in order (start-up: where the wait before step 1 goes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.parts: dict[str, dict[str, float]] = {}
        """What some phases consist of (phase -> part -> seconds), where a part is known."""

    @contextlib.contextmanager
    def time(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def describe(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())

    def describe_parts(self) -> str:
        """`phase = part X s + part Y s; ...`, or "" when no part is known."""
        return "; ".join(f"{phase} = " + " + ".join(f"{name} {seconds:.1f} s" for name, seconds in parts.items())
                         for phase, parts in self.parts.items() if parts)


class ProgressReporter:
    """Reports finished steps: `loss`/`progress` events, TensorBoard, and a progress bar in a terminal or a
    progress line every few seconds in a log file. The rank that does not report (not rank 0) only keeps time.

    `emit(type, **fields)` sends an event.
    """

    LOG_EVERY_S = 5.0

    def __init__(self, numbers: RunNumbers, emit: Callable[..., None], start_step: int, tensorboard_dir: Path | None,
                 reports: bool) -> None:
        self.numbers = numbers
        self.emit = emit
        self.main = reports
        self.start_step = start_step
        self.last_step = start_step
        self.start_time = time.perf_counter()
        self.last_time = self.start_time
        self.last_log = self.start_time
        self.step_s: float | None = None
        self.images_per_s = 0.0
        self.rank_step_s: list[float | None] = []  # each rank's smoothed step time, for its images/s
        self.bar = None
        self.writer = None
        if self.main:
            if sys.stderr.isatty():
                from tqdm import tqdm
                self.bar = tqdm(total=numbers.total_steps, initial=start_step, unit="step", dynamic_ncols=True)
            if tensorboard_dir is not None:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(str(tensorboard_dir))

    def step(self, report) -> None:
        """Report a finished step (the loop is one step further by now; see step_exchange)."""
        n = self.numbers
        step, loss_mean, lr = report.step, report.loss, report.lr
        now = time.perf_counter()
        # The step's own time as the loop measured it when it sent the step (the slowest rank's), else the
        # time between reports: reports arrive a step late, and two may come at once (the last one of a
        # stopped run right after the one before: a run stopped at step 2 showed 797 images/s, not 0.5).
        measured = max(getattr(report, "rank_step_s", None) or [0.0])
        dt = measured if measured > 0 else now - self.last_time
        self.last_time = now
        self.last_step = step
        # The step time is smoothed, not the rate: a report that arrives right after the one before
        # it (the GPU had already finished, e.g. after a save synchronised it) would otherwise add an
        # absurd rate. The first step (warm-up: kernel autotuning, first allocations) is left out.
        if step > self.start_step + 1:
            self.step_s = dt if self.step_s is None else 0.9 * self.step_s + 0.1 * dt
            self.images_per_s = n.global_batch / self.step_s if self.step_s > 0 else 0.0
        if not self.main:
            return
        left = n.total_steps - step
        eta = left * n.global_batch / self.images_per_s if self.images_per_s > 0 else None
        self.emit("loss", step=step, loss=loss_mean, lr=lr, **self._per_rank_losses(report))
        self.emit("progress", epoch=report.epoch + 1, epochs=n.epochs, step=step, total_steps=n.total_steps,
                  images_per_s=round(self.images_per_s, 3), eta_s=round(eta, 1) if eta is not None else None,
                  **self._per_rank_rates(report))
        if self.writer is not None:
            self.writer.add_scalar("loss", loss_mean, step)
            self.writer.add_scalar("lr", lr, step)
            self.writer.add_scalar("images_per_s", self.images_per_s, step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss_mean:.4f}", img_s=f"{self.images_per_s:.1f}", epoch=report.epoch + 1)
        elif now - self.last_log >= self.LOG_EVERY_S or step == n.total_steps:
            self.last_log = now
            rate = f"{self.images_per_s:.1f} img/s" if self.images_per_s > 0 else "measuring speed"
            log.info("step %d/%d (%d%%) · epoch %d/%d · loss %.4f · %s · ETA %s", step, n.total_steps,
                     100 * step // max(1, n.total_steps), report.epoch + 1, n.epochs, loss_mean, rate,
                     format_seconds(eta))

    def summary(self) -> dict:
        """Images trained since this reporter started, the seconds it took and their ratio: the rate of the
        whole run as its user waited for it (first step, samples and backups included), not a step rate."""
        seconds = time.perf_counter() - self.start_time
        images = (self.last_step - self.start_step) * self.numbers.global_batch
        return {"images": images, "train_s": round(seconds, 2),
                "images_per_s": round(images / seconds, 2) if seconds > 0 else 0.0}

    # Per-rank numbers are optional in a report (one process has none worth showing); getattr keeps
    # reports that carry none, like the tests' stand-ins, working.
    def _per_rank_losses(self, report) -> dict:
        """`rank_losses` for the GUI's per-GPU view, with several processes only."""
        losses = getattr(report, "rank_losses", [])
        return {"rank_losses": losses} if len(losses) > 1 else {}

    def _per_rank_rates(self, report) -> dict:
        """`rank_images_per_s`: each rank's local images per step over its own smoothed step time (the
        warm-up step left out, as for the total)."""
        step_s = getattr(report, "rank_step_s", [])
        if len(step_s) < 2:
            return {}
        if len(self.rank_step_s) != len(step_s):
            self.rank_step_s = [None] * len(step_s)
        if report.step > self.start_step + 1:
            for rank, dt in enumerate(step_s):
                if dt > 0:
                    last = self.rank_step_s[rank]
                    self.rank_step_s[rank] = dt if last is None else 0.9 * last + 0.1 * dt
        local = self.numbers.per_gpu_batch * self.numbers.accumulation
        return {"rank_images_per_s": [round(local / s, 3) if s else 0.0 for s in self.rank_step_s]}

    def validation(self, step: int, loss: float) -> None:
        """The validation loss (TensorBoard `validation_loss`, beside the training `loss`)."""
        if self.writer is not None:
            self.writer.add_scalar("validation_loss", loss, step)

    def log_image(self, tag: str, image, step: int) -> None:
        """An image sample, or a clip (`Clip`) as an animated GIF."""
        if self.writer is None:
            return
        from modules.util.animation import Clip
        if isinstance(image, Clip):
            # The writer has no public call for a ready-made summary; this is the route its add_* calls take.
            self.writer._get_file_writer().add_summary(animated_summary(tag, image), step)
        else:
            import numpy as np
            self.writer.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def animated_summary(tag: str, clip):
    """An image summary holding `clip` as GIF bytes: what `SummaryWriter.add_video` writes, without the moviepy it
    needs to encode them (TensorBoard's image dashboard plays it)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    width, height = clip.size
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=clip.gif_bytes())
    return Summary(value=[Summary.Value(tag=tag, image=image)])
