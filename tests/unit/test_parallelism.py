"""The run's parallelism: what one process, DDP and FSDP each decide, without a process group.

Training under each is tests/integration/test_trainer.py's (one process), tests/integration/test_distributed.py's (DDP) and
tests/integration/test_fsdp.py's (FSDP), through the real launchers; here the decisions themselves.
"""
from __future__ import annotations

import contextlib
import types

import pytest
import torch
from torch import nn

from modules.config import TrainConfig
from modules.distributed.ddp import DDPParallelism
from modules.distributed.fsdp import FSDPParallelism, ShardedBackups
from modules.model.streamed_save import LOCAL
from modules.trainer.backup_writer import BackgroundBackups
from modules.trainer.parallelism import SingleProcess
from modules.trainer.split_probe import decide_split
from modules.util import dist_utils as du


def test_one_process_wraps_nothing_syncs_nothing_and_writes_on_rank_0_in_the_background(tmp_path):
    single = SingleProcess()
    model, params = nn.Linear(2, 2), [nn.Parameter(torch.zeros(1))]
    wrapped, trained = single.wrap(model, params)
    assert wrapped is model and trained is params and single.unwrap(wrapped) is model
    assert isinstance(single.gradient_sync(model, last_micro_batch=False), contextlib.nullcontext)
    assert isinstance(single.sampling_calls(model, contextlib.nullcontext()), contextlib.nullcontext)
    assert single.extra_calls(mine=1, total=5) == 0
    assert single.write_model(lambda: "written") == "written"
    assert single.tensor_source(torch.device("cpu")) is LOCAL
    assert (single.data_rank, single.data_world, single.holds_whole_model) == (0, 1, True)
    cfg = TrainConfig()
    cfg.general.workspace_dir = str(tmp_path)
    parts = types.SimpleNamespace(cfg=cfg, paths=types.SimpleNamespace(backups=tmp_path / "backups"))
    backups = single.backups(parts, "run-1")
    assert isinstance(backups, BackgroundBackups) and backups.writer is not None
    backups.close()


def test_a_backup_of_whole_tensors_is_copied_into_the_trained_weights():
    weight = nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    saved = torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    saved.param_groups[0]["params"][0].grad = torch.ones(3)
    saved.step()
    SingleProcess().load_whole_backup(nn.Linear(1, 1), optimizer, None, {"unet.w": weight},
                                      {"unet.w": torch.full((3,), 2.0, dtype=torch.float64)},
                                      {"optimizer": saved.state_dict(), "ema": None})
    assert weight.dtype == torch.float32 and torch.equal(weight.detach(), torch.full((3,), 2.0))
    assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"], torch.ones(3))


@pytest.mark.parametrize("world, rank, mine, total, extra", [(3, 0, 2, 5, 0), (3, 2, 1, 5, 1), (2, 1, 0, 1, 1)])
def test_where_each_forward_is_collective_every_rank_calls_the_model_as_often(monkeypatch, world, rank, mine,
                                                                              total, extra):
    monkeypatch.setattr(du, "world_size", lambda: world)
    monkeypatch.setattr(du, "rank", lambda: rank)
    sharded = FSDPParallelism(TrainConfig().training, cpu_offload=False, device=torch.device("cpu"))
    assert sharded.forward_is_collective and not sharded.holds_whole_model
    assert sharded.extra_calls(mine, total) == extra
    assert SingleProcess().extra_calls(mine, total) == 0


def test_samples_replay_graphs_only_where_each_call_is_one_processs_own(monkeypatch):
    """`sampling.cuda_graphs` applies in one process and under DDP; not where a forward gathers weights from every
    rank (FSDP) or a context-parallel group splits each call's sequence over its processes."""
    monkeypatch.setattr(du, "world_size", lambda: 4)
    monkeypatch.setattr(du, "rank", lambda: 1)
    ddp = DDPParallelism(TrainConfig().multi_gpu, torch.device("cpu"))
    assert SingleProcess().sampling_replays_graphs and ddp.sampling_replays_graphs
    ddp.use_context_parallel(2)
    assert not ddp.sampling_replays_graphs
    assert not FSDPParallelism(TrainConfig().training, cpu_offload=False, device=torch.device("cpu")).sampling_replays_graphs


def test_fsdp_places_only_the_frozen_parts_and_checkpoints_when_it_shards():
    frozen, trained = nn.Linear(2, 2), nn.Linear(2, 2)
    moved = []
    for module in (frozen, trained):
        module.to = lambda device, m=module: moved.append(m) or m
    bundle = types.SimpleNamespace(modules=lambda: {"vae": frozen, "unet": trained},
                                   denoiser=types.SimpleNamespace(enable_gradient_checkpointing=lambda: moved.append("ckpt")))
    sharded = FSDPParallelism(TrainConfig().training, cpu_offload=False, device=torch.device("cpu"))
    sharded.place(bundle, [trained], torch.device("cpu"))
    sharded.checkpoint_activations(bundle)  # done per block when sharding, not by diffusers
    assert moved == [frozen]
    SingleProcess().checkpoint_activations(bundle)
    assert moved == [frozen, "ckpt"]
    assert isinstance(sharded.backups(types.SimpleNamespace(), "run-1"), ShardedBackups)


def test_ddp_splits_the_compiled_graph_only_where_gradients_fill_more_than_two_buckets():
    ddp = DDPParallelism(TrainConfig().multi_gpu, torch.device("cpu"))
    bucket = TrainConfig().multi_gpu.bucket_cap_mb * 2 ** 20
    lora = [nn.Parameter(torch.zeros(bucket // 4))]  # fp32: one bucket of gradients
    full = [nn.Parameter(torch.zeros(3 * bucket // 4))]
    assert not ddp.compile_splits_at_buckets(lora) and ddp.compile_splits_at_buckets(full)
    assert not SingleProcess().compile_splits_at_buckets(full)
    model = nn.Linear(1, 1)
    assert ddp.unwrap(types.SimpleNamespace(module=model)) is model


def test_batch_split_auto_gives_equal_batches_where_no_rank_holds_the_whole_model(monkeypatch):
    monkeypatch.setattr(du, "local_world_size", lambda: 2)
    measured = []
    split = decide_split("auto", 4, 2, holds_whole_model=False, device_names=lambda: ["GPU 0", "GPU 1"],
                         measure=lambda: measured.append(1))
    assert split == [4, 4] and not measured
    assert decide_split("6,2", 4, 2, True, lambda: ["GPU 0", "GPU 1"], lambda: None) == [6, 2]
