"""The images/s shown to users: the warm-up step left out, no spike when two reports arrive together."""
from types import SimpleNamespace

import pytest

from modules.trainer import progress as progress_module
from modules.trainer.progress import ProgressReporter


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_rate_averages_step_times_and_ignores_a_report_that_comes_at_once(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    events = []
    trainer = SimpleNamespace(
        global_step=0, numbers=SimpleNamespace(total_steps=10, global_batch=8, epochs=1),
        cfg=SimpleNamespace(general=SimpleNamespace(tensorboard=False)),
        emit=lambda type_, **fields: events.append((type_, fields)))
    reporter = ProgressReporter(trainer)
    report = lambda step: SimpleNamespace(step=step, loss=0.5, lr=1e-4, epoch=0)  # noqa: E731
    clock.now += 30.0  # the first step: autotuning, allocations
    reporter.step(report(1))
    assert reporter.images_per_s == 0.0
    for step in range(2, 10):
        clock.now += 0.5
        reporter.step(report(step))
    assert reporter.images_per_s == pytest.approx(16.0)
    reporter.step(report(10))  # the last report, right after the one before it (the GPU was done)
    assert 16.0 < reporter.images_per_s < 18.0
    progress = [f for t, f in events if t == "progress"]
    assert progress[0]["eta_s"] is None and progress[-1]["images_per_s"] < 18.0
