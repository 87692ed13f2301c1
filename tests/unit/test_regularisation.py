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
from tests.unit.test_data import write_image


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


def test_a_balanced_epoch_resumes_mid_way_also_with_another_global_batch():
    buckets = [0] * 24
    groups = [TRAIN] * 12 + [REGULARISATION] * 12
    full = BucketBatchSampler(buckets, 4, seed=2, groups=groups)
    full.set_epoch(3)
    whole = list(full)
    stopped = BucketBatchSampler(buckets, 4, seed=2, groups=groups)
    stopped.set_epoch(3)
    stopped.mark_consumed(2)
    resumed = BucketBatchSampler(buckets, 4, seed=2, groups=groups)
    resumed.load_state_dict(stopped.state_dict())
    assert whole[:2] + list(resumed) == whole
    # Another global batch (2 GPUs x 4): the rest of the epoch regrouped, still balanced, nothing repeated.
    ranks = [BucketBatchSampler(buckets, 4, world_size=2, rank=r, seed=2, groups=groups) for r in range(2)]
    for sampler in ranks:
        sampler.load_state_dict(stopped.state_dict())
    rest = [a + b for a, b in zip(*(list(s) for s in ranks))]
    assert all(sorted(groups[i] for i in batch) == [TRAIN] * 4 + [REGULARISATION] * 4 for batch in rest)
    assert not {i for batch in rest for i in batch} & {i for batch in whole[:2] for i in batch}
    # A backup from before the groups existed (other digest) restarts the epoch instead of misplacing it.
    plain = BucketBatchSampler(buckets, 4, seed=2)
    plain.set_epoch(3)
    plain.mark_consumed(2)
    resumed.load_state_dict(plain.state_dict())
    assert resumed.consumed_batches == 0


def test_every_declared_role_is_acted_on(tmp_path):
    """Each choice `data.concepts[].role` declares (train_config.CONCEPT_ROLES) puts a concept's images in a place
    of its own: trained as training items, balanced in as regularisation items, or held out for validation."""
    from modules.config.train_config import CONCEPT_ROLES
    from modules.data.roles import item_groups
    train = images(tmp_path / "train", 2, "t")
    other = images(tmp_path / "other", 2, "o")
    places = {}
    for role in CONCEPT_ROLES:
        scan = scan_concepts([ConceptConfig(path=str(train)), ConceptConfig(path=str(other), role=role)])
        groups = item_groups(scan.images, scan.item_images) or [TRAIN] * len(scan.item_images)
        trained_as = {groups[k] for k, i in enumerate(scan.item_images) if scan.images[i].path.parent == other}
        held_out = any(im.path.parent == other for im in scan.validation)
        places[role] = (tuple(sorted(trained_as)), held_out)
        assert trained_as or held_out, f"role {role!r}: its images went nowhere"
    assert places == {"train": ((TRAIN,), False), "regularisation": ((REGULARISATION,), False),
                      "validation": ((), True)}
