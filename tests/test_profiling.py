"""The profiler summary's arithmetic: busy time is the union of GPU activity, counted once."""
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from modules.benchmark.profiling import busy_seconds, device_activity


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
