"""Backup snapshots (modules/util/host_copy.py): staged on the GPU when it has room, else pinned host memory."""
import pytest
import torch

from modules.util import host_copy
from modules.util.host_copy import GIB, SnapshotPlan, gpu_bytes, snapshot_to_host, stage_on_gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")


def fake_gpu(monkeypatch, free_gib: float, reserved_gib: float, peak_gib: float, total_gib: float = 80.0) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * GIB), int(total_gib * GIB)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(reserved_gib * GIB))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: int(peak_gib * GIB))


def test_a_snapshot_is_staged_on_the_gpu_only_with_room_beside_trainings_peak(monkeypatch):
    cuda = torch.device("cuda", 0)
    # 50 GiB free now, 20 reserved now, 30 at the peak: 40 GiB free at the peak; 8 GiB spare kept on 80.
    fake_gpu(monkeypatch, free_gib=50, reserved_gib=20, peak_gib=30)
    fits, why = stage_on_gpu(10 * GIB, cuda)
    assert fits and "10.0 GiB fits in the 40.0 GiB free at training's peak (keeping 8.0 GiB spare)" == why
    assert not stage_on_gpu(33 * GIB, cuda)[0]
    fake_gpu(monkeypatch, free_gib=6, reserved_gib=14, peak_gib=16, total_gib=24)  # a 24 GB card: 4 GiB at the peak
    fits, why = stage_on_gpu(3 * GIB, cuda)
    assert not fits and "does not fit" in why and "2.4 GiB spare" in why
    assert stage_on_gpu(0, cuda) == (False, "no GPU tensors") and not stage_on_gpu(GIB, torch.device("cpu"))[0]


def test_the_plan_is_decided_at_the_first_backup_and_kept(monkeypatch):
    decisions = iter([(True, "first"), (False, "second")])
    monkeypatch.setattr(host_copy, "stage_on_gpu", lambda size, device: next(decisions))
    plan = SnapshotPlan()
    assert plan.decide(GIB, torch.device("cuda", 0)) and plan.decide(GIB, torch.device("cuda", 0))
    assert plan.reason == "first"


def test_cpu_tensors_are_copied_whichever_way_is_asked():
    for staged in (False, True):
        live = {"w": torch.ones(3), "step": 4, "rng": (1, [2, 3])}
        snap = snapshot_to_host(live, stage_on_gpu=staged)
        live["w"].add_(1)
        value = snap.ready()
        assert torch.equal(value["w"], torch.ones(3)) and value["rng"] == (1, [2, 3]) and gpu_bytes(live) == 0


@needs_cuda
@pytest.mark.parametrize("staged", [False, True])
def test_a_gpu_snapshot_holds_its_steps_values_while_the_next_steps_change_them(staged):
    """The copies are queued on the stream: the in-place updates queued after them (the next optimizer
    steps) must not reach the snapshot, staged or not; a staged one leaves nothing on the GPU once read."""
    device = torch.device("cuda")
    live = {"weights": {"w": torch.randn(4096, 4096, device=device)}, "adam": [torch.randn(1024, device=device)],
            "step": torch.tensor(7)}
    expected = {"w": live["weights"]["w"].cpu(), "adam": live["adam"][0].cpu()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    snap = snapshot_to_host(live, stage_on_gpu=staged)
    for _ in range(20):  # slow enough that the GPU is still busy when the snapshot is read
        live["weights"]["w"].mul_(1.01).add_(live["weights"]["w"] @ live["weights"]["w"] * 1e-6)
        live["adam"][0].add_(1)
    value = snap.ready()
    assert value["weights"]["w"].device.type == "cpu" and torch.equal(value["weights"]["w"], expected["w"])
    assert torch.equal(value["adam"][0], expected["adam"]) and int(value["step"]) == 7
    assert torch.cuda.memory_allocated(device) <= before + 64 * 2 ** 20  # the clones are gone
