"""`multi_gpu.memory_limit_gib` in the worker: each GPU held to its limit, and an out-of-memory error that
ends the run with the figure (which GPU, what it asked for, its limit, the plan's estimate, what to change)
instead of CUDA's traceback. PyTorch's error is raised here on CPU processes, as a GPU raises it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from modules.config import TrainConfig
from modules.trainer import memory_limit

TORCH_SAYS = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
              "55.20 GiB is free. Of the allocated memory 20.91 GiB is allocated by PyTorch, and 1.02 GiB is reserved "
              "by PyTorch but unallocated.")


def test_each_gpu_is_held_to_its_limit(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2 ** 30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: calls.append((f, device)))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = TrainConfig()
    device = torch.device("cuda", 0)
    assert memory_limit.hold_to_memory_limit(cfg, device) is None and calls == []  # no limit: the whole card
    cfg.multi_gpu.memory_limit_gib = "24,16"
    assert memory_limit.hold_to_memory_limit(cfg, device) == 16.0  # local rank 1: the second number
    assert calls == [(16 / 80, device)]
    cfg.multi_gpu.memory_limit_gib = "100"
    assert memory_limit.hold_to_memory_limit(cfg, device) == 80.0  # never more than the card
    assert memory_limit.hold_to_memory_limit(cfg, torch.device("cpu")) is None


def fake_trainer(step: int, limit: str = "24,16"):
    from modules.planning.memory_plan import Candidate, Plan
    from modules.planning.memory_need import Need, Setup

    cfg = TrainConfig()
    cfg.multi_gpu.memory_limit_gib = limit
    cfg.training.batch_size = 4
    cfg.training.method = "lora"
    cfg.training.precision = "bf16"
    needs = [Need({}, 14.1, 9.0, 8.0), Need({}, 13.2, 9.0, 8.0)]
    plan = Plan(Candidate("FSDP + fp8 base", Setup("fsdp", 2, fp8=True)), needs, [4, 4], [24.0, 16.0], "test")
    return SimpleNamespace(cfg=cfg, device=torch.device("cpu"), global_step=step, first_step_done=True, model=object(),
                           strategy=SimpleNamespace(plan=plan))


def test_out_of_memory_becomes_the_figure_and_what_to_change(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    error = memory_limit.explained(torch.OutOfMemoryError(TORCH_SAYS), fake_trainer(step=2))
    assert isinstance(error, memory_limit.MemoryLimitExceeded)
    text = str(error)
    assert text.startswith("rank 1 ran out of memory at step 3: it asked for 2.50 GiB more, beyond its limit of 16 "
                           "GiB (multi_gpu.memory_limit_gib). The plan, FSDP + fp8 base, estimated 13.2 GiB for it. "
                           "To fit: lower training.batch_size (now 4;")
    assert "turn on training.gradient_checkpointing" in text and "raise multi_gpu.memory_limit_gib" in text
    assert "--plan-for" in text and "Traceback" not in text
    other = ValueError("not about memory")
    assert memory_limit.explained(other, fake_trainer(step=2)) is other


def test_a_worker_that_runs_out_of_memory_ends_with_the_figure_not_a_traceback(tmp_path, monkeypatch, caplog):
    """The trainer's run turns PyTorch's error into the figures before its clean-up; run_worker records that
    for the launcher (whose last line names the first rank that failed) and logs one line, no traceback."""
    from modules.config import RunPaths
    from modules.distributed import failures, worker
    from modules.distributed.distributed_trainer import DistributedTrainer
    from modules.distributed.job import WorkerJob
    from modules.launch.spec import resolve_launch

    cfg = TrainConfig()
    cfg.general.workspace_dir = str(tmp_path / "ws")
    cfg.general.device = "cpu"
    cfg.multi_gpu.enabled, cfg.multi_gpu.num_gpus, cfg.multi_gpu.memory_limit_gib = True, 2, "24"

    def run_out_of_memory(self):  # the seventh step runs out of memory
        self.first_step_done, self.global_step = True, 6
        self.heartbeat.at("training step", 7)
        raise torch.OutOfMemoryError(TORCH_SAYS)

    monkeypatch.setattr(DistributedTrainer, "start", run_out_of_memory)
    monkeypatch.setattr(worker, "setup_logging", lambda: None)  # a worker's handlers would outlive this test
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    job = WorkerJob(cfg, resolve_launch(cfg, 0))
    with pytest.raises(memory_limit.MemoryLimitExceeded) as raised, caplog.at_level("ERROR", logger="tandem"):
        worker.run_worker(job)
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)  # the details file keeps CUDA's own words
    recorded = failures.read_errors(failures.failures_folder(RunPaths(cfg).workspace))[1]
    assert recorded.kind == "MemoryLimitExceeded" and recorded.step == 7
    assert recorded.text.startswith("rank 1 ran out of memory at step 7: it asked for 2.50 GiB more, beyond its "
                                    "limit of 24 GiB (multi_gpu.memory_limit_gib).")
    first = failures.first_failure([], {1: recorded})
    assert "rank 1" in first.text and "24 GiB" in first.text
    # This rank's own trouble, whatever its words: never taken for a lost peer's complaint.
    assert not recorded.secondary and not failures.is_secondary("MemoryLimitExceeded", "the step timed out")
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("rank 1 failed: MemoryLimitExceeded: rank 1 ran out of memory") for m in said), said
    assert not any(r.exc_info for r in caplog.records)  # no traceback logged
