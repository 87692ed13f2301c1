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
from modules.distributed.mesh import LayoutMesh
from modules.launch.layout import ParallelLayout
from modules.model.streamed_save import LOCAL
from modules.trainer.backup_writer import BackgroundBackups
from modules.trainer.parallelism import SingleProcess
from modules.trainer.split_probe import decide_split
from modules.util import dist_utils as du


def fsdp(layout: ParallelLayout) -> FSDPParallelism:
    """FSDP over `layout`'s processes (its mesh is built only when a model is sharded: never here)."""
    return FSDPParallelism(TrainConfig().training, False, torch.device("cpu"), LayoutMesh(layout.sharded(True), "cpu"))


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
    monkeypatch.setattr(du, "rank", lambda: rank)
    sharded = fsdp(ParallelLayout.of(world))
    assert sharded.forward_is_collective and not sharded.holds_whole_model
    assert sharded.extra_calls(mine, total) == extra
    assert SingleProcess().extra_calls(mine, total) == 0


def test_samples_replay_graphs_only_where_each_call_is_one_processs_own(monkeypatch):
    """`sampling.cuda_graphs` applies in one process and under DDP; not where a forward gathers weights from every
    rank (FSDP) or a context-parallel group splits each call's sequence over its processes."""
    monkeypatch.setattr(du, "rank", lambda: 1)
    ddp = DDPParallelism(TrainConfig().multi_gpu, torch.device("cpu"), ParallelLayout.of(4))
    assert SingleProcess().sampling_replays_graphs and ddp.sampling_replays_graphs
    in_groups = DDPParallelism(TrainConfig().multi_gpu, torch.device("cpu"), ParallelLayout.of(4, 2))
    assert not in_groups.sampling_replays_graphs
    assert (in_groups.data_rank, in_groups.data_world, in_groups.context_rank) == (0, 2, 1)
    assert not fsdp(ParallelLayout.of(4)).sampling_replays_graphs


def test_fsdp_places_only_the_frozen_parts_and_checkpoints_when_it_shards():
    frozen, trained = nn.Linear(2, 2), nn.Linear(2, 2)
    moved = []
    for module in (frozen, trained):
        module.to = lambda device, m=module: moved.append(m) or m
    bundle = types.SimpleNamespace(modules=lambda: {"vae": frozen, "unet": trained},
                                   denoiser=types.SimpleNamespace(enable_gradient_checkpointing=lambda: moved.append("ckpt")))
    sharded = fsdp(ParallelLayout.of(2))
    sharded.place(bundle, [trained], torch.device("cpu"))
    sharded.checkpoint_activations(bundle)  # done per block when sharding, not by diffusers
    assert moved == [frozen]
    SingleProcess().checkpoint_activations(bundle)
    assert moved == [frozen, "ckpt"]
    assert isinstance(sharded.backups(types.SimpleNamespace(), "run-1"), ShardedBackups)


def test_ddp_splits_the_compiled_graph_only_where_gradients_fill_more_than_two_buckets():
    ddp = DDPParallelism(TrainConfig().multi_gpu, torch.device("cpu"), ParallelLayout.of(2))
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


@pytest.mark.parametrize("strategy, groups_of, loss_scale", [("single", 1, 1.0), ("ddp", 2, 2.0)])
def test_a_steps_micro_batches_add_up_and_exchange_gradients_once_at_the_last(strategy, groups_of, loss_scale):
    """`forward_backward`, the micro-batch schedule: every micro-batch's loss backward with its weight (this rank's
    share x the layout's loss scale / the micro-batches), DDP's `no_sync` on all but the last, the mean loss."""
    entered = []

    class Wrapped:  # DDP's wrapper, as the schedule sees it
        @contextlib.contextmanager
        def no_sync(self):
            entered.append("no_sync")
            yield

    parallel = SingleProcess() if strategy == "single" else \
        DDPParallelism(TrainConfig().multi_gpu, torch.device("cpu"), ParallelLayout.of(2, groups_of))
    weight, seen = nn.Parameter(torch.tensor(1.0)), []

    def loss_of(batch, index):
        seen.append(index)
        return weight * batch["x"]

    loss = parallel.forward_backward(Wrapped(), [{"x": 1.0}, {"x": 2.0}, {"x": 3.0}], loss_of,
                                     torch.amp.GradScaler("cpu", enabled=False), share=0.5)
    assert seen == [0, 1, 2] and float(loss) == 2.0
    assert float(weight.grad) == pytest.approx((1 + 2 + 3) * 0.5 * loss_scale / 3)
    assert entered == ([] if strategy == "single" else ["no_sync", "no_sync"])


def test_the_strategies_are_found_by_name_and_take_the_layout_they_need():
    from modules.config.validation import CHOICES
    from modules.distributed.distributed_trainer import STRATEGIES
    from modules.distributed.mesh import LayoutMesh

    assert set(STRATEGIES) == set(CHOICES["multi_gpu", "strategy"]) - {"auto"}
    layout = ParallelLayout.of(2)
    for name, strategy in STRATEGIES.items():
        mesh = LayoutMesh(layout.sharded(not strategy.holds_whole_model), "cpu")
        parallel = strategy.for_run(TrainConfig(), torch.device("cpu"), mesh, None)
        assert parallel.name == name and parallel.layout is mesh.layout
    with pytest.raises(ValueError, match="ddp keeps the whole model on every process: a layout of 2 processes with "
                                         "shard 2"):
        DDPParallelism(TrainConfig().multi_gpu, torch.device("cpu"), layout.sharded(True))
    with pytest.raises(ValueError, match="fsdp shards the weights over every process: a layout of 2 processes with "
                                         "shard 1"):
        FSDPParallelism(TrainConfig().training, False, torch.device("cpu"), LayoutMesh(layout, "cpu"))
