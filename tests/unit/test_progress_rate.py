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
    numbers = SimpleNamespace(total_steps=10, global_batch=8, epochs=1)
    reporter = ProgressReporter(numbers, lambda type_, **fields: events.append((type_, fields)), 0, None, True)
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


def test_a_run_stopped_at_step_2_shows_its_real_rate(monkeypatch):
    """Step 1's report arrives during step 2 and a stopped run's last report right after it: the time
    between the two reports said 797 images/s. The steps' own times (sent with them) say 1."""
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    numbers = SimpleNamespace(total_steps=100, global_batch=2, per_gpu_batch=1, accumulation=1, epochs=1)
    reporter = ProgressReporter(numbers, lambda *a, **k: None, 0, None, True)
    clock.now += 6.0
    reporter.step(SimpleNamespace(step=1, loss=0.5, lr=1e-4, epoch=0, rank_step_s=[0.0, 0.0]))
    clock.now += 0.001
    reporter.step(SimpleNamespace(step=2, loss=0.5, lr=1e-4, epoch=0, rank_step_s=[1.9, 2.0]))
    assert reporter.images_per_s == pytest.approx(1.0)  # 2 images per 2-second step


def test_short_runs_report_the_rate_the_user_waited_for(monkeypatch):
    """A 2-step run printed 3,000 img/s: its rate came from one step time. The run's rate is images / wall time."""
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    numbers = SimpleNamespace(total_steps=2, global_batch=8, epochs=1)
    reporter = ProgressReporter(numbers, lambda *a, **k: None, 0, None, True)
    clock.now += 5.0
    reporter.step(SimpleNamespace(step=1, loss=0.5, lr=1e-4, epoch=0))
    clock.now += 0.001  # the second report arrives at once
    reporter.step(SimpleNamespace(step=2, loss=0.5, lr=1e-4, epoch=0))
    clock.now += 1.0  # saving the model
    assert reporter.summary() == {"images": 16, "train_s": 6.0, "images_per_s": round(16 / 6.001, 2)}


def test_a_log_read_by_people_gets_a_progress_line_every_few_seconds(monkeypatch, caplog):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    monkeypatch.setattr(progress_module.sys.stderr, "isatty", lambda: False)
    monkeypatch.setattr(progress_module.log, "propagate", True)  # to caplog, whatever set up logging before
    numbers = SimpleNamespace(total_steps=100, global_batch=8, epochs=2)
    reporter = ProgressReporter(numbers, lambda *a, **k: None, 0, None, True)
    with caplog.at_level("INFO", logger="tandem"):
        for step in range(1, 101):
            clock.now += 0.5
            reporter.step(SimpleNamespace(step=step, loss=0.25, lr=1e-4, epoch=(step - 1) // 50))
    lines = [r.getMessage() for r in caplog.records]
    assert 8 <= len(lines) <= 12  # 50 s of training, a line every 5 s, and the last step
    assert lines[-1].startswith("step 100/100 (100%) · epoch 2/2 · loss 0.2500 · 16.0 img/s · ETA 0s")
    assert "@tandem" not in "".join(lines)


def test_events_only_when_asked_for(monkeypatch):
    from modules.trainer.callbacks import EventLineReporter, default_callbacks

    monkeypatch.delenv("TANDEM_EVENTS", raising=False)
    assert not isinstance(default_callbacks(), EventLineReporter)  # a pipe or a file: a log for people
    monkeypatch.setenv("TANDEM_EVENTS", "1")
    assert isinstance(default_callbacks(), EventLineReporter)


def test_library_notices_that_say_nothing_to_a_user_stay_out_of_the_log(caplog):
    """Dynamo's lru_cache notice about diffusers' upsampling (20 lines at each torch.compile of an SD UNet)
    stays out of the log; other warnings still pass."""
    import logging
    import warnings
    from modules.util.logs import quiet_libraries

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        quiet_libraries()
        warnings.warn("Dynamo detected a call to a `functools.lru_cache`-wrapped function at 'upsampling.py:156'. "
                      "Dynamo ignores the cache wrapper and directly traces the wrapped function.", UserWarning)
        warnings.warn("Some weights of the model checkpoint were not used", UserWarning)
    assert [str(w.message) for w in shown] == ["Some weights of the model checkpoint were not used"]
    with caplog.at_level(logging.WARNING):
        logging.getLogger("diffusers.models.modeling_utils").warning("The modules [] should be kept in float32")
        logging.getLogger("diffusers.models.modeling_utils").warning("Missing weights: conv_in.weight")
    assert [r.getMessage() for r in caplog.records] == ["Missing weights: conv_in.weight"]
