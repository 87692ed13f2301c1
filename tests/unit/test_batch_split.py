"""Unequal GPUs (multi_gpu.batch_split): uneven parts of one global batch train what one process trains."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from modules.config import ConfigError
from modules.data import BucketBatchSampler
from modules.model.objective import draw_noise
from modules.util.batch_slice import (BatchSlice, RankCapacity, SplitDoesNotFit, choose_split, describe_split,
                                      parse_split)
from tests.trainer_helpers import demo_config, latest_backup_weights, relative_l2


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def test_parts_and_weights():
    parts = [BatchSlice.of([3, 1], r) for r in range(2)]
    assert parts == [BatchSlice(0, 3, 4), BatchSlice(3, 1, 4)]
    # DDP averages over 2 ranks: 3/4 and 1/4 of the gradient after weighting by share x world.
    assert [p.loss_weight(2) for p in parts] == [1.5, 0.5]
    assert BatchSlice.of([2, 2], 1).loss_weight(2) == 1.0
    assert describe_split([6, 2]) == "global batch 8 = 6 on GPU 0 + 2 on GPU 1"


def test_parse_split_names_what_is_wrong():
    assert parse_split("equal", 2, 4) is None and parse_split("auto", 2, 4) == "auto"
    assert parse_split(" 6, 2 ", 2, 4) == [6, 2]
    for text, reason in (("6,1", "adds up to 7"), ("8", "1 batch size"), ("8,0", "at least 1"), ("big", "not equal, auto")):
        with pytest.raises(ValueError, match=reason):
            parse_split(text, 2, 4)


def test_config_validation_of_batch_split():
    with pytest.raises(ConfigError, match=r"multi_gpu.batch_split: '6,1' adds up to 7.*global batch is training.batch_size 4"):
        demo_config(Path("/tmp/x"), Path("/tmp/y"), "training.batch_size=4", "multi_gpu.batch_split=6,1")
    demo_config(Path("/tmp/x"), Path("/tmp/y"), "training.batch_size=4", "multi_gpu.batch_split=6,2")


def test_choose_split_follows_speed_and_memory():
    fast, slow = RankCapacity(float("inf"), 1, 1.0), RankCapacity(float("inf"), 1, 3.0)
    assert choose_split(8, [fast, slow]) == [6, 2]  # the slow GPU gets a third of the fast one's share
    assert choose_split(8, [fast, fast]) == [4, 4]
    small = RankCapacity(free_bytes=2.5, bytes_per_sample=1, seconds_per_sample=1.0)
    assert choose_split(8, [fast, small]) == [6, 2]  # room for 2 only
    # both decide (test_auto_split_fits_each_ranks_room_and_speed's launch): by speed 5 + 1, room caps it at 4
    assert choose_split(6, [RankCapacity(4, 1, 1.0), RankCapacity(8, 1, 3.0)]) == [4, 2]
    with pytest.raises(SplitDoesNotFit, match="GPU 0: 2, GPU 1: 2"):
        choose_split(8, [small, small])
    with pytest.raises(SplitDoesNotFit, match="no memory left"):
        choose_split(8, [fast, RankCapacity(0.5, 1, 1.0)])


def test_uneven_sampler_parts_make_the_global_batches():
    buckets = [0] * 24
    whole = list(BucketBatchSampler(buckets, 4, world_size=1, rank=0, seed=3))
    parts = [list(BucketBatchSampler(buckets, 2, world_size=2, rank=r, seed=3, split=[3, 1])) for r in range(2)]
    assert [a + b for a, b in zip(*parts)] == whole
    assert {len(b) for b in parts[0]} == {3} and {len(b) for b in parts[1]} == {1}


def test_uneven_parts_draw_the_noise_of_the_whole_batch():
    whole = draw_noise((4, 4, 8, 8), 1000, 3, 5, 1, BatchSlice(0, 4, 4), torch.device("cpu"), offset_noise=0.1)
    a = draw_noise((3, 4, 8, 8), 1000, 3, 5, 1, BatchSlice(0, 3, 4), torch.device("cpu"), offset_noise=0.1)
    b = draw_noise((1, 4, 8, 8), 1000, 3, 5, 1, BatchSlice(3, 1, 4), torch.device("cpu"), offset_noise=0.1)
    assert torch.equal(torch.cat([a.noise, b.noise]), whole.noise)
    assert torch.equal(torch.cat([a.timesteps, b.timesteps]), whole.timesteps)


# ------------------------------------------------------------------ real runs, 2 CPU processes over gloo

EXACT = ("training.precision=fp32", "optimizer.name=sgd", "training.learning_rate=0.05")


def single(workspace, cache, *overrides, resume=None):
    from modules.trainer.generic_trainer import GenericTrainer
    GenericTrainer(demo_config(workspace, cache, *overrides), resume=resume).run()


def two(workspace, cache, split, *overrides, resume=None):
    from modules.distributed.launch import launch
    cfg = demo_config(workspace, cache, "training.batch_size=2", *overrides, "multi_gpu.enabled=true",
                      "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn", f"multi_gpu.batch_split={split}")
    assert launch(cfg, resume=resume) == 0


@pytest.mark.slow
def test_ranks_with_3_and_1_then_1_and_3_train_what_one_process_with_4_trains(tmp_path, cache_dir):
    """Ranks with 3 and 1 samples for 2 steps, resumed with the split turned round (1 and 3) for 2 more: the
    weights of 1 process x 4 for 4 steps. With 2 micro-batches a step (the uneven parts' loss weights applied in
    every micro-batch, the gradient synchronised only in the last). One launch per split serves what were two
    tests (CI time); without accumulation an uneven split is held to 1 process by
    test_auto_split_fits_each_ranks_room_and_speed (4 + 2, accumulation 1)."""
    common = ("training.max_steps=4", "save.backup_every_n_steps=2", "training.gradient_accumulation_steps=2",
              *EXACT)
    single(tmp_path / "ref", cache_dir, *common, "training.batch_size=4")
    two(tmp_path / "run", cache_dir, "3,1", *common, "training.max_steps=2")
    two(tmp_path / "run", cache_dir, "1,3", *common, resume="latest")
    one, uneven = latest_backup_weights(tmp_path / "ref"), latest_backup_weights(tmp_path / "run")
    assert relative_l2(uneven, one) <= 1e-6
    assert any(v.abs().max() > 0 for k, v in one.items() if "lora_B" in k)  # the comparison is not of zeros


@pytest.mark.slow
def test_auto_split_fits_each_ranks_room_and_speed(tmp_path, cache_dir, capfd, monkeypatch):
    """One launch, where both the room and the speeds decide: a global batch of 6 on a rank 3x as fast with
    room for 4 samples (the other for 8) is 4 + 2 - by speed alone 5 + 1, by room alone 3 + 3 (the choice
    itself for every case: test_choose_split_follows_speed_and_memory) - and the 4 + 2 parts train what 1
    process with 6 trains. Launched in this process (as the GUI launches; the script adds nothing to the split)."""
    # the speeds are given too: two CPU processes on a loaded machine measure speeds that differ by chance
    monkeypatch.setenv("TANDEM_SIMULATE_SAMPLE_ROOM", "4,8")
    monkeypatch.setenv("TANDEM_SIMULATE_SAMPLE_SECONDS", "0.01,0.03")
    common = ("training.max_steps=2", "save.backup_every_n_steps=2", *EXACT)
    capfd.readouterr()
    two(tmp_path / "two", cache_dir, "auto", *common, "training.batch_size=3")
    out = "\n".join(capfd.readouterr())
    found = re.search(r"Batch split \(auto, measured\): (global batch .*?) \(", out)
    assert found and found.group(1) == describe_split([4, 2], ["CPU process 0", "CPU process 1"]), out[-3000:]
    assert "per-GPU batch 4 + 2 x accumulation 1 = global batch 6" in out, "the split was not trained with"
    single(tmp_path / "one", cache_dir, *common, "training.batch_size=6")
    assert relative_l2(latest_backup_weights(tmp_path / "two"), latest_backup_weights(tmp_path / "one")) <= 1e-6


def test_probe_counts_a_memory_cap_as_the_cards_size():
    from modules.trainer.split_probe import free_for_tensors
    gib = 1 << 30
    # 80 GiB card, 70 free, the allocator holds 6 of which 4 in tensors: uncapped, 70 + 2 may still be used
    assert free_for_tensors(70 * gib, 80 * gib, 6 * gib, 4 * gib, 1.0) == 72 * gib
    # capped at a quarter (20 GiB): 20 - 6 more may be reserved, plus the 2 held unused
    assert free_for_tensors(70 * gib, 80 * gib, 6 * gib, 4 * gib, 0.25) == 16 * gib
    # a cap below what is reserved leaves nothing, not a negative room
    assert free_for_tensors(70 * gib, 80 * gib, 30 * gib, 30 * gib, 0.25) == 0
