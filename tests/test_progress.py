"""Start-up phase timing: where the wait before the first step goes."""
import time

from modules.trainer.progress import PhaseTimes


def test_phase_times_add_up_per_name_in_order_and_survive_errors():
    phases = PhaseTimes()
    with phases.time("model"):
        time.sleep(0.02)
    try:
        with phases.time("cache"):
            raise OSError("disk full")
    except OSError:
        pass
    with phases.time("model"):
        time.sleep(0.02)
    assert list(phases.seconds) == ["model", "cache"]
    assert phases.seconds["model"] >= 0.04
    assert phases.describe() == f"model {phases.seconds['model']:.1f} s, cache {phases.seconds['cache']:.1f} s"
