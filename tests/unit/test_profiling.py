"""The profiler summary's arithmetic: busy time is the union of GPU activity, counted once."""
import os
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from modules.trainer.step_profile import busy_seconds, device_activity


def test_busy_time_counts_overlaps_once_and_gaps_not_at_all():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0, 1e6)]) == pytest.approx(1.0)
    # Two streams overlapping for half a second, a nested kernel, then a gap of 1 s before the last one.
    spans = [(0, 1e6), (5e5, 1.5e6), (6e5, 7e5), (2.5e6, 3e6)]
    assert busy_seconds(spans) == pytest.approx(2.0)
    assert busy_seconds(list(reversed(spans))) == pytest.approx(2.0)


def _event(name, start, end, device=DeviceType.CUDA, annotation=False):
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end))


def test_gpu_activity_leaves_out_host_operators_and_annotations():
    events = [
        _event("aten::mm", 0, 50, device=DeviceType.CPU),  # the operator that launched the kernel
        _event("ampere_bf16_gemm", 10, 40),
        _event("Optimizer.step#AdamW.step", 40, 200, annotation=True),  # spans kernels and gaps
        _event("multi_tensor_apply_kernel", 60, 80),
        _event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 30, 120),
    ]
    compute, nccl = device_activity(events)
    assert compute == [(10, 40), (60, 80)] and nccl == [(30, 120)]
    assert busy_seconds(compute + nccl) == pytest.approx(110e-6)


@pytest.mark.parametrize("text, steps", [("100:5", (100, 5)), ("40", (40, 5)), (" 2:1 ", (2, 1))])
def test_the_steps_to_profile_are_first_and_count(text, steps):
    from modules.trainer.step_profile import profile_steps
    assert profile_steps(text) == steps


@pytest.mark.parametrize("text", ["1", "0:5", "100:0", "abc", "100:x", "100-105"])
def test_steps_that_cannot_be_profiled_name_the_variable_and_the_form(text):
    from modules.trainer.step_profile import profile_steps
    with pytest.raises(ValueError, match=r"TANDEM_PROFILE_STEPS=.*FIRST\[:COUNT\].*100:5"):
        profile_steps(text)


@pytest.mark.slow
def test_a_run_profiles_the_steps_asked_for_and_reports_them(tmp_path, tandem_home):
    """TANDEM_PROFILE_STEPS on a real run (one process): steps 2-3 profiled, a report written, one line logged
    and a `profile` event emitted at step 3. (Two ranks: tests/integration/test_wall_clock.py::
    test_a_two_rank_spawn_run_samples_backs_up_profiles_and_exits_at_once.)"""
    from modules.trainer.callbacks import RecordingCallbacks
    from modules.trainer.generic_trainer import GenericTrainer
    from tests.trainer_helpers import demo_config

    callbacks = RecordingCallbacks()
    cfg = demo_config(tmp_path / "ws", tmp_path / "cache", "training.max_steps=4")
    os.environ["TANDEM_PROFILE_STEPS"] = "2:2"
    try:
        GenericTrainer(cfg, callbacks).run()
    finally:
        del os.environ["TANDEM_PROFILE_STEPS"]
    (event,) = callbacks.of_type("profile")
    assert (event["first"], event["last"]) == (2, 3) and len(event["ranks"]) == 1
    assert event["ranks"][0]["steps"] == 2 and event["ranks"][0]["wall_s"] > 0
    (report,) = (tmp_path / "ws" / "profiles").glob("*-steps-2-3-rank0.txt")
    assert "Top operators by host (CPU) time" in report.read_text()


# Every rank profiling the same steps and the lead reporting all of them (2 processes) is checked on a
# 2-rank spawn launch shared with other checks: tests/integration/test_wall_clock.py::
# test_a_two_rank_spawn_run_samples_backs_up_profiles_and_exits_at_once.


def test_a_wrong_value_stops_the_run_before_training_with_the_fix(tmp_path, tandem_home):
    from modules.trainer.generic_trainer import GenericTrainer
    from tests.trainer_helpers import demo_config

    os.environ["TANDEM_PROFILE_STEPS"] = "1"
    try:
        with pytest.raises(ValueError, match="FIRST at least 2"):
            GenericTrainer(demo_config(tmp_path / "ws", tmp_path / "cache", "training.max_steps=2")).run()
    finally:
        del os.environ["TANDEM_PROFILE_STEPS"]
    assert not list((tmp_path / "ws").glob("output/*"))
