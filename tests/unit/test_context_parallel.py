"""`multi_gpu.context_parallel`: each sample's sequence split over the processes of a group (CPU, gloo, spawned as
the launcher spawns them). 2 processes in one group of 2 train the weights 1 process trains with the same batch
(DDP and FSDP; LoRA, fp32); the config's rules refuse what cannot work, naming the field and the fix."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch

from modules.config import ConfigError
from modules.distributed.launch import launch
from modules.trainer.backup import latest_backup
from modules.trainer.sharded_backup import read_trained_weights
from modules.util.animation import read_frames
from tests.trainer_helpers import assert_weights_close, demo_config, train

LORA_TARGETS = 'training.lora_target_modules=["to_q","to_k","to_v","to_out.0","ffn.net.0.proj","ffn.net.2"]'


def wan(workspace, cache, *overrides):
    return demo_config(workspace, cache, "training.precision=fp32", "training.max_steps=2",
                       "save.backup_every_n_steps=1", "optimizer.name=sgd", "training.learning_rate=0.05",
                       LORA_TARGETS, *overrides, method="lora", preset="#demo_wan")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_group_of_two_processes_trains_what_one_process_trains(tandem_home, tmp_path, strategy, capfd, caplog):
    """With DDP the run also samples at its end and scores held-out items: the group renders each clip and scores
    each batch together (the transformer's calls split over both processes); the clips are those one process
    renders, the validation losses those it computes."""
    caplog.set_level(logging.INFO, logger="tandem")
    cache = tmp_path / "cache"
    samples = ("sampling.every_n_steps=2", "sampling.inference_steps=2", "sampling.video_frames=5",
               "data.validation_fraction=0.1", "training.validation_every_n_steps=2") if strategy == "ddp" else ()
    train(wan(tmp_path / "one", cache, "training.batch_size=2", *samples))
    assert launch(wan(tmp_path / "two", cache, "training.batch_size=2", "multi_gpu.enabled=true",
                      "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn", f"multi_gpu.strategy={strategy}",
                      "multi_gpu.context_parallel=2", *samples)) == 0
    single = read_trained_weights(latest_backup(tmp_path / "one" / "backups").path)
    assert single
    assert_weights_close(read_trained_weights(latest_backup(tmp_path / "two" / "backups").path), single,
                         atol=2e-5, rtol=1e-4)
    if samples:
        out = "\n".join(capfd.readouterr())
        found = re.findall(r"Validation loss at step (\d+): ([0-9.]+)", caplog.text + out)
        by_step: dict[str, list[float]] = {}
        for step, loss in found:
            by_step.setdefault(step, []).append(float(loss))
        assert set(by_step) == {"0", "2"} and all(len(v) == 2 for v in by_step.values()), found  # 1 process, then 2
        assert all(v[0] == pytest.approx(v[1], rel=1e-4) for v in by_step.values()), by_step
        ours, theirs = (sorted((tmp_path / run / "samples").rglob("*.webp")) for run in ("two", "one"))
        assert [p.name for p in ours] == [p.name for p in theirs] == ["step-0000002-0.webp", "step-0000002-1.webp"]
        for mine, reference in zip(ours, theirs):
            a, b = (np.stack([np.asarray(frame, dtype=np.int16) for frame, _ in read_frames(p)]) for p in (mine, reference))
            assert a.shape == b.shape and np.abs(a - b).max() <= 2


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.usefixtures("one_torch_thread")
def test_two_groups_of_two_train_what_one_process_trains_with_both_groups_batches(tandem_home, tmp_path):
    """4 processes = 2 data slices x 2 context: each group trains its half of the global batch of 4, and the
    weights are those of 1 process with batch 4 (the groups' ranks: 0-1 and 2-3)."""
    cache = tmp_path / "cache"
    train(wan(tmp_path / "one", cache, "training.batch_size=4"))
    assert launch(wan(tmp_path / "four", cache, "training.batch_size=2", "multi_gpu.enabled=true",
                      "multi_gpu.num_gpus=4", "multi_gpu.launcher=spawn", "multi_gpu.strategy=ddp",
                      "multi_gpu.context_parallel=2")) == 0
    single = read_trained_weights(latest_backup(tmp_path / "one" / "backups").path)
    assert_weights_close(read_trained_weights(latest_backup(tmp_path / "four" / "backups").path), single,
                         atol=2e-5, rtol=1e-4)


def multi(*overrides: str):
    from modules.config import TrainConfig, apply_overrides
    return apply_overrides(TrainConfig(), ["model.base_model=unused.safetensors", "multi_gpu.enabled=true",
                                           *overrides])


@pytest.mark.parametrize("overrides, words", [
    (("model.model_type=flux", "multi_gpu.context_parallel=2"), ["Flux.1", "cannot", "Wan", "Set it to 1"]),
    (("model.model_type=wan", "multi_gpu.context_parallel=2", "multi_gpu.num_gpus=3"),
     ["must divide the number of GPUs (3)", "use 3"]),
    (("model.model_type=wan", "multi_gpu.context_parallel=2", "training.compile=on"), ["training.compile"]),
    (("model.model_type=wan", "multi_gpu.context_parallel=2", "multi_gpu.batch_split=auto"),
     ["batch_split", "set multi_gpu.batch_split to equal"]),
])
def test_what_context_parallelism_cannot_do_is_refused_naming_the_field_and_the_fix(overrides, words):
    from modules.config.validation import validate
    problems = " ".join(str(p) for p in validate(multi(*overrides)))
    assert "multi_gpu.context_parallel: 2" in problems and all(w in problems for w in words), problems
    assert not [p for p in validate(multi("model.model_type=wan", "multi_gpu.context_parallel=2",
                                          "multi_gpu.num_gpus=4")) if "context_parallel" in str(p)]


def test_heads_and_every_buckets_tokens_must_divide_among_the_group():
    from modules.distributed.context_parallel import indivisible
    assert indivisible(2, 12, [(640, 640), (512, 768)], 16) is None
    assert "12 attention heads" in indivisible(8, 12, [(640, 640)], 16)
    problem = indivisible(2, 12, [(640, 640), (624, 624)], 16)
    assert "624x624 bucket has 1521 per frame (39 x 39" in problem and "multiples of 32" in problem


def test_the_global_batch_and_lr_count_groups_not_processes():
    from modules.launch.spec import resolve_launch
    spec = resolve_launch(multi("model.model_type=wan", "general.device=cpu", "multi_gpu.num_gpus=4",
                                "multi_gpu.context_parallel=2", "training.batch_size=3", "multi_gpu.lr_scaling=linear",
                                "training.learning_rate=0.001"), 0)
    assert spec.problem is None and spec.world_size == 4 and spec.data_world == 2
    assert spec.global_batch == 6 and spec.lr == pytest.approx(0.002)
    odd = resolve_launch(multi("model.model_type=wan", "general.device=cpu", "multi_gpu.num_gpus=3",
                               "multi_gpu.context_parallel=2"), 0)
    assert "must divide the number of GPUs (3)" in odd.problem


def test_the_start_up_line_counts_processes_and_their_groups():
    """4 processes in 1 group of 4 train one slice of each global batch: the log says 4 processes and 1 group,
    not "world size 1"; without context parallelism it says the processes alone."""
    from modules.launch.spec import resolve_launch
    from modules.trainer.run_numbers import derive_run_numbers
    cfg = multi("model.model_type=wan", "general.device=cpu", "multi_gpu.num_gpus=4", "multi_gpu.context_parallel=4",
                "training.batch_size=1")
    spec = resolve_launch(cfg, 0)
    numbers = derive_run_numbers(cfg, spec.data_world, 10, launch=spec)
    assert numbers.processes == 4 and numbers.world_size == 1
    line = numbers.describe()
    assert line.startswith("4 processes in 1 group of 4 (context parallel) | per-group batch 1 x accumulation 1 x 1 "
                           "= global batch 1 |"), line
    assert "world size" not in line
    plain = multi("model.model_type=wan", "general.device=cpu", "multi_gpu.num_gpus=2", "training.batch_size=3")
    spec = resolve_launch(plain, 0)
    line = derive_run_numbers(plain, spec.data_world, 10, launch=spec).describe()
    assert line.startswith("2 processes | per-GPU batch 3 x accumulation 1 x 2 = global batch 6 |"), line


def test_each_process_of_a_group_is_planned_for_its_part_of_the_clip():
    """The memory estimate: a process of a group of 2 keeps the activations of half the clip's tokens (the
    text's whole)."""
    from modules.planning.memory_need import Setup, activation_bytes_per_sample, facts
    from modules.planning.model_sizes import model_sizes
    per = {}
    for degree in (1, 2):
        cfg = multi("model.model_type=wan", "training.method=lora", "training.precision=bf16",
                    "data.resolution=640", "data.video_frames=81", "training.gradient_checkpointing=true",
                    f"multi_gpu.context_parallel={degree}")
        per[degree] = activation_bytes_per_sample(facts(model_sizes(cfg), cfg), cfg, Setup("fsdp", 2))
    clip, text = 21 * (640 // 16) ** 2, 512
    assert per[2] / per[1] == pytest.approx((clip / 2 + text) / (clip + text))


def test_a_family_split_is_checked_with_the_loaded_models_pixels_per_token():
    """Before anything is split: a model found by `auto` that cannot split is refused, and tokens are counted with
    the loaded model's patch size - Wan 2.2 TI2V 5B's 32 px (its 16x VAE), where a 544 px side is 17 tokens (289
    per frame, which 2 does not divide) though 16 px would make it 34."""
    from types import SimpleNamespace

    from modules.distributed.context_parallel import ContextParallel
    from modules.distributed.mesh import LayoutMesh
    from modules.launch.layout import ParallelLayout
    from modules.model.families import family

    groups = ContextParallel(LayoutMesh(ParallelLayout.of(2, 2), "cpu"))  # refused before its mesh is built
    denoiser = SimpleNamespace(config={"num_attention_heads": 24})
    ti2v = SimpleNamespace(family=family("wan"), denoiser=denoiser,
                           vae=SimpleNamespace(config=SimpleNamespace(scale_factor_spatial=16)))
    with pytest.raises(ValueError, match=r"544x544 bucket has 289 per frame \(17 x 17: a token per 32 px\)"):
        groups.split(ti2v, torch.device("cpu"), [(544, 544)])
    flux = SimpleNamespace(family=family("flux"), denoiser=denoiser, vae=None)
    with pytest.raises(ValueError, match=r"which Flux.1 \(dev, schnell\) cannot.*Set it to 1"):
        groups.split(flux, torch.device("cpu"), [(512, 512)])
