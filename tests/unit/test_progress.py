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


def test_phase_parts_are_described_only_where_known():
    phases = PhaseTimes()
    phases.seconds.update({"launch": 3.0, "set-up": 1.0})
    assert phases.describe_parts() == ""
    phases.parts["launch"] = {"checks": 1.0, "imports": 2.0}
    phases.parts["set-up"] = {}
    assert phases.describe_parts() == "launch = checks 1.0 s + imports 2.0 s"
