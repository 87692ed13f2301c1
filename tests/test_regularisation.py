"""Regularisation (prior-preservation) concepts: kohya's balance of as many regularisation items as training
items per epoch, mixed evenly into every global batch, weighted by the concept's loss weight."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modules.config import TrainConfig, validate
from modules.config.train_config import ConceptConfig, DataConfig
from modules.data import BucketBatchSampler, build_dataset, collate, scan_concepts
from modules.data.roles import REGULARISATION, TRAIN
from modules.model.objective import weighted_mean
from tests.test_data import write_image


def images(folder: Path, count: int, prefix: str) -> Path:
    for i in range(count):
        write_image(folder / f"{prefix}{i}.png", colour=(10 * i, 100, 50), caption=f"{prefix} {i}")
    return folder


def concepts(tmp_path, train: int, train_repeats: int, reg: int, reg_repeats: int, reg_weight: float = 1.0):
    return [ConceptConfig(path=str(images(tmp_path / "train", train, "t")), repeats=train_repeats),
            ConceptConfig(path=str(images(tmp_path / "reg", reg, "r")), repeats=reg_repeats, role="regularisation",
                          loss_weight=reg_weight)]


def names(scan) -> list[str]:
    return [scan.images[i].path.stem for i in scan.item_images]


@pytest.mark.parametrize("reg,reg_repeats,expected", [
    (4, 1, ["r0", "r1", "r2", "r3", "r0", "r1"]),  # fewer: around again
    (10, 1, ["r0", "r1", "r2", "r3", "r4", "r5"]),  # more: the first ones this many
    (2, 2, ["r0", "r1", "r0", "r1", "r0", "r1"]),  # repeats in turn, then around again
    (4, 2, ["r0", "r1", "r2", "r3", "r0", "r1"]),  # every image before any repeat
])
def test_an_epoch_holds_as_many_regularisation_items_as_training_items(tmp_path, reg, reg_repeats, expected):
    scan = scan_concepts(concepts(tmp_path, 3, 2, reg, reg_repeats))
    assert names(scan)[:6] == ["t0", "t0", "t1", "t1", "t2", "t2"]
    assert names(scan)[6:] == expected


def test_every_global_batch_is_half_training_half_regularisation_on_any_number_of_ranks(tmp_path):
    cfg = DataConfig(concepts=concepts(tmp_path, 8, 1, 3, 1), resolution=64, bucket_step=64, num_workers=0)
    dataset = build_dataset(cfg, tmp_path / "cache", seed=5)
    groups = dataset.item_groups()
    assert groups.count(TRAIN) == groups.count(REGULARISATION) == 8
    plans = []
    for world in (1, 2):
        ranks = [BucketBatchSampler(dataset.buckets, 4 // world, world_size=world, rank=r, seed=5, groups=groups)
                 for r in range(world)]
        for sampler in ranks:
            sampler.set_epoch(1)
        batches = [sum(parts, []) for parts in zip(*(list(s) for s in ranks))]
        plans.append(batches)
        for batch in batches:
            assert sorted(groups[i] for i in batch) == [TRAIN, TRAIN, REGULARISATION, REGULARISATION]
    assert plans[0] == plans[1], "2 ranks x 2 take exactly the global batches of 1 rank x 4"
    assert sorted(i for batch in plans[0] for i in batch) == list(range(16))


def test_loss_weight_multiplies_each_samples_loss():
    dataset_weights = torch.tensor([1.0, 0.5])
    per_sample = torch.tensor([2.0, 4.0])
    assert weighted_mean(per_sample, dataset_weights).item() == pytest.approx((2.0 + 0.5 * 4.0) / 2)
    assert torch.equal(weighted_mean(per_sample, torch.ones(2)), per_sample.mean())


def test_items_carry_their_concepts_loss_weight(tmp_path):
    cfg = DataConfig(concepts=concepts(tmp_path, 2, 1, 2, 1, reg_weight=0.3), resolution=64, bucket_step=64,
                     num_workers=0, cache_latents=False)
    dataset = build_dataset(cfg, tmp_path / "cache", seed=0)
    batch = collate([dataset[i] for i in range(len(dataset))])
    assert batch["loss_weights"].tolist() == pytest.approx([1.0, 1.0, 0.3, 0.3])


def test_roles_are_checked():
    cfg = TrainConfig()
    cfg.data.concepts = [ConceptConfig(path="builtin:demo-shapes", role="regularization")]
    problems = validate(cfg, check_paths=False)
    assert any(p.startswith("data.concepts[0].role: 'regularization' is not a valid choice; set it to one of "
                            "train, regularisation, validation") and "did you mean 'regularisation'?" in p
               for p in problems), problems
    assert any("no enabled concept has role 'train'" in p for p in problems)
    cfg.data.concepts = [ConceptConfig(path="builtin:demo-shapes", loss_weight=-1.0, unmasked_weight=2.0)]
    problems = validate(cfg, check_paths=False)
    assert any(p.startswith("data.concepts[0].loss_weight: -1.0") for p in problems)
    assert any(p.startswith("data.concepts[0].unmasked_weight: 2.0") for p in problems)
