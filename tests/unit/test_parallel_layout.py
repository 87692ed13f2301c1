"""The run's parallel layout (`modules/launch/layout.py`): one value for how the processes split the training,
checked when it is made, carried by the launch spec through the job file to the worker; and the learning rates
the launch scales once and everything after it carries."""
from __future__ import annotations

import dataclasses

import pytest

from modules.config import TrainConfig, apply_overrides, load_config
from modules.launch.layout import ParallelLayout
from modules.launch.spec import LaunchSpec, resolve_launch
from modules.trainer.run_numbers import derive_run_numbers


def multi(*overrides):
    """A config as edited (unchecked: the launch says what cannot start)."""
    return apply_overrides(TrainConfig(), ["model.model_type=wan", "model.base_model=unused.safetensors",
                                           "multi_gpu.enabled=true", "general.device=cpu", *overrides])


def test_the_group_arithmetic_of_four_processes_in_groups_of_two():
    layout = ParallelLayout.of(4, 2)
    assert (layout.data, layout.context, layout.shard, layout.processes) == (2, 2, 1, 4)
    assert [layout.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.context_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert layout.loss_scale == 2.0 and layout.mesh_dimensions == {"data": 2, "ring": 1, "ulysses": 2}
    assert layout.describe() == "4 processes in 2 groups of 2 (context parallel)"
    plain = ParallelLayout.of(3)
    assert [plain.data_rank(r) for r in range(3)] == [0, 1, 2] and plain.mesh_dimensions == {"data": 3}
    assert plain.describe() == "3 processes" and ParallelLayout().describe() == "1 process"
    assert layout.sharded(True).shard == 4 and layout.sharded(True).sharded(False) == layout


@pytest.mark.parametrize("make, words", [
    (lambda: ParallelLayout.of(3, 2), r"multi_gpu.context_parallel: 2 must divide the number of processes \(3\)"),
    (lambda: ParallelLayout(data=0), r"data is 0; it counts processes"),
    (lambda: ParallelLayout(data=2, context=1.5), r"context is 1.5"),
    (lambda: ParallelLayout(data=2, context=2, shard=2), r"shard 2 over 4 processes.*fsdp: shard 4.*ddp: shard 1"),
])
def test_a_layout_that_cannot_be_is_refused_naming_the_setting_and_the_fix(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_the_launch_carries_its_layout_through_the_job_file():
    spec = resolve_launch(multi("multi_gpu.num_gpus=4", "multi_gpu.context_parallel=2"), 0)
    assert spec.layout == ParallelLayout(data=2, context=2) and spec.data_world == 2
    assert LaunchSpec.from_dict(spec.as_dict()) == spec
    with pytest.raises(ValueError, match="a layout of 4 processes in 2 groups of 2 .* for 2 processes"):
        dataclasses.replace(spec, world_size=2)
    # A context that does not divide the processes: the launch says why it cannot start, and still has a layout.
    odd = resolve_launch(multi("multi_gpu.num_gpus=3", "multi_gpu.context_parallel=2"), 0)
    assert "must divide the number of GPUs (3)" in odd.problem and odd.layout == ParallelLayout(data=3)


def test_a_round_on_fewer_processes_keeps_its_groups():
    """4 processes in 2 groups of 2, one machine of 2 lost: 1 group of 2 accumulates twice as many micro-batches;
    3 processes cannot form groups of 2, which the error says."""
    from modules.distributed.job import WorkerJob
    from modules.distributed.plan import LaunchError
    from modules.distributed.worker import keep_global_batch

    cfg = multi("multi_gpu.num_gpus=2", "multi_gpu.nnodes=2", "multi_gpu.master_port=29500", "multi_gpu.min_gpus=2",
                "multi_gpu.max_restarts=1", "multi_gpu.context_parallel=2", "training.batch_size=1")
    job = WorkerJob(cfg, resolve_launch(cfg, 0), run_id="run-x")
    assert job.spec.layout == ParallelLayout(data=2, context=2) and job.spec.global_batch == 2
    smaller = keep_global_batch(job, 2)
    assert smaller.spec.layout == ParallelLayout(data=1, context=2) and smaller.spec.accumulation == 2
    assert smaller.spec.global_batch == 2
    with pytest.raises(LaunchError, match=r"continuing on 3 of 4 processes: multi_gpu.context_parallel: 2 must divide"):
        keep_global_batch(job, 3)


def test_the_learning_rates_are_scaled_once_and_carried():
    """sqrt scaling over 4 processes: the launch multiplies the denoiser's and the text encoders' learning rates
    by 2, once; the run numbers carry both (the optimizer's groups and a LoRA's metadata read them) and a round
    on fewer processes keeps them."""
    from modules.distributed.job import WorkerJob
    from modules.distributed.worker import keep_global_batch

    cfg = load_config("#demo", ["multi_gpu.enabled=true", "general.device=cpu", "multi_gpu.num_gpus=2",
                                "multi_gpu.nnodes=2", "multi_gpu.master_port=29500", "multi_gpu.min_gpus=2",
                                "multi_gpu.max_restarts=1", "multi_gpu.lr_scaling=sqrt",
                                "training.learning_rate=3e-4", "training.text_encoder_learning_rate=7e-5"])
    spec = resolve_launch(cfg, 0)
    assert (spec.lr_factor, spec.lr, spec.text_encoder_lr) == (2.0, 3e-4 * 2.0, 7e-5 * 2.0)
    smaller = keep_global_batch(WorkerJob(cfg, spec, run_id="run-x"), 2)
    numbers = derive_run_numbers(smaller.cfg, 2, 40, launch=smaller.spec)
    assert numbers.group_lrs(text_encoders=True) == [3e-4 * 2.0, 7e-5 * 2.0]
    assert numbers.group_lrs(text_encoders=False) == [3e-4 * 2.0]
    assert "LR 0.0003 -> 0.0006 (sqrt scaling x2)" in numbers.describe()
    same = resolve_launch(load_config("#demo", ["multi_gpu.enabled=true", "general.device=cpu",
                                                "multi_gpu.num_gpus=2", "training.learning_rate=3e-4"]), 0)
    assert same.text_encoder_lr == same.lr == 3e-4  # no text-encoder LR of its own: the denoiser's
