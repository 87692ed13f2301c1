"""Masked training: `<image>-masklabel.png` files, their crop/flip and cache at latent resolution, and a loss
that leaves out the latents a mask weighs 0 - exactly, for every model family."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from modules.config.train_config import ConceptConfig, DataConfig
from modules.data import build_dataset, collate, scan_concepts
from modules.data.masks import MaskError
from modules.model.objective import per_sample_mse
from tests.unit.test_data import FakeEncoders, write_image


def write_mask(image: Path, white_columns: int, size=None) -> Path:
    """A mask whose first `white_columns` columns are white (learn), the rest black."""
    width, height = size or Image.open(image).size
    mask = Image.new("L", (width, height), 0)
    mask.paste(255, (0, 0, white_columns, height))
    path = image.with_name(image.stem + "-masklabel.png")
    mask.save(path)
    return path


def masked_cfg(folder: Path, **overrides) -> DataConfig:
    cfg = DataConfig(concepts=[ConceptConfig(path=str(folder), masks=True, **overrides.pop("concept", {}))],
                     resolution=64, bucket_step=64, num_workers=0)  # one 64x64 bucket
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture
def masked_folder(tmp_path) -> Path:
    root = tmp_path / "masked"
    write_image(root / "square.png", caption="a square")
    write_image(root / "wide.png", size=(96, 64), caption="a wide picture")
    write_image(root / "plain.png", caption="no mask")
    write_mask(root / "square.png", 32)  # left half learns
    write_mask(root / "wide.png", 48)  # left half of 96 columns: after the centre crop, columns 0-31 of 64
    return root


def test_mask_files_are_found_and_never_trained_as_images(masked_folder, caplog):
    scan = scan_concepts([ConceptConfig(path=str(masked_folder), masks=True)])
    names = sorted(im.path.name for im in scan.images)
    assert names == ["plain.png", "square.png", "wide.png"], "a -masklabel.png file is a mask, not an image"
    masks = {im.path.name: im.mask_path and im.mask_path.name for im in scan.images}
    assert masks == {"plain.png": None, "square.png": "square-masklabel.png", "wide.png": "wide-masklabel.png"}
    assert "1 of 3 image(s)" in caplog.text and "plain.png" in caplog.text
    # A concept without masks leaves the mask files alone too (still not images).
    plain = scan_concepts([ConceptConfig(path=str(masked_folder))])
    assert len(plain.images) == 3 and all(im.mask_path is None for im in plain.images)


def test_a_mask_of_another_size_is_an_error_naming_both_files(masked_folder):
    write_mask(masked_folder / "plain.png", 10, size=(32, 32))
    with pytest.raises(MaskError, match=r"plain-masklabel.png is 32x32 but its image plain.png is 64x64"):
        scan_concepts([ConceptConfig(path=str(masked_folder), masks=True)])


@pytest.mark.parametrize("cached", [True, False])
def test_masks_follow_the_images_crop_and_flip_at_latent_resolution(masked_folder, tmp_path, cached):
    """The wide image is centre-cropped from 96 to 64 columns: its mask (left 48 of 96 white) becomes the left
    32 of 64, i.e. latent columns 0-3 of 8; flipped, columns 4-7. Cached and uncached masks agree."""
    cfg = masked_cfg(masked_folder, cache_latents=cached, random_flip=True, concept={"unmasked_weight": 0.25})
    dataset = build_dataset(cfg, tmp_path / "cache", seed=3)
    if cached:
        dataset.cache(FakeEncoders().encode_images, None, "fake", progress=False)
        assert len(list((tmp_path / "cache" / "masks").iterdir())) == 2, "one mask entry per masked image"
    names = [dataset.images[i].path.name for i in dataset.item_images]
    left = torch.tensor([1.0] * 4 + [0.25] * 4).expand(1, 8, 8)
    seen_flips = set()
    for epoch in range(8):
        for index, name in enumerate(names):
            item = dataset[(epoch, index)]
            assert item["mask"].shape == (1, 8, 8) and item["mask"].dtype == torch.float32
            if name == "plain.png":
                assert torch.equal(item["mask"], torch.ones(1, 8, 8)), "no mask file: the whole image learns"
                continue
            mirrored = torch.flip(left, dims=[-1])
            assert torch.equal(item["mask"], left) or torch.equal(item["mask"], mirrored), f"{name}: {item['mask']}"
            seen_flips.add(torch.equal(item["mask"], mirrored))
    assert seen_flips == {True, False}, "random flips mirror the mask with the image"
    batch = collate([dataset[(0, i)] for i in range(len(names)) if names[i] != "wide.png"])
    assert batch["masks"].shape == (2, 1, 8, 8) and batch["loss_weights"].tolist() == [1.0, 1.0]


def test_cached_masks_do_not_depend_on_the_number_of_ranks(masked_folder, tmp_path):
    cfg = masked_cfg(masked_folder)
    for ranks, cache in ((1, tmp_path / "one"), (2, tmp_path / "two")):
        dataset = build_dataset(cfg, cache, seed=0)
        for rank in range(ranks):
            dataset.cache(FakeEncoders().encode_images, None, "fake", rank=rank, world_size=ranks, progress=False)
    one = sorted(p.name for p in (tmp_path / "one" / "masks").iterdir())
    assert one == sorted(p.name for p in (tmp_path / "two" / "masks").iterdir())
    for name in one:
        assert (tmp_path / "one" / "masks" / name).read_bytes() == (tmp_path / "two" / "masks" / name).read_bytes()


def test_zero_mask_leaves_those_latents_out_of_the_loss_exactly():
    torch.manual_seed(0)
    pred = torch.randn(2, 4, 8, 8, requires_grad=True)
    target = torch.randn(2, 4, 8, 8)
    mask = torch.ones(2, 1, 8, 8)
    mask[..., 4:] = 0.0  # the right half of every image weighs nothing
    loss = per_sample_mse(pred, target, mask)
    other_target = target.clone()
    other_target[..., 4:] = 1e3  # anything at all where the mask is 0
    assert torch.equal(per_sample_mse(pred, other_target, mask), loss)
    loss.sum().backward()
    assert torch.count_nonzero(pred.grad[..., 4:]) == 0 and torch.count_nonzero(pred.grad[..., :4]) > 0
    # The kept half's loss is the plain mean over it (same scale as an unmasked image).
    torch.testing.assert_close(loss, ((pred - target) ** 2)[..., :4].mean(dim=(1, 2, 3)), rtol=1e-6, atol=0)


def make_masked_demo(folder: Path, count: int = 8) -> Path:
    """`count` demo images (64x64) with masks whose right half is black."""
    from modules.data.demo_dataset import ensure_demo_dataset
    demo = ensure_demo_dataset()
    folder.mkdir(parents=True, exist_ok=True)
    for path in sorted(demo.glob("*.png"))[:count]:
        shutil.copy(path, folder / path.name)
        shutil.copy(path.with_suffix(".txt"), folder / f"{path.stem}.txt")
        write_mask(folder / path.name, 32)
    return folder


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("model", ["builtin:demo", "builtin:demo-sd3", "builtin:demo-flux"])
def test_every_family_leaves_masked_latents_out_of_the_trained_loss(tmp_path, tandem_home, model):
    """Through the real trainer (cached masks, each family's objective - Flux's 2x2-packed prediction
    included): whatever the target holds where the mask is 0 changes neither the loss nor a gradient."""
    from modules.trainer.generic_trainer import GenericTrainer
    from tests.trainer_helpers import demo_config
    folder = make_masked_demo(tmp_path / "data")
    cfg = demo_config(tmp_path / "run", tmp_path / "cache", f"model.base_model={model}", "training.min_snr_gamma=0",
                      "model.t5_max_length=24", "training.batch_size=4", "data.caption_dropout=0",
                      "training.precision=fp32", "training.max_steps=1")
    cfg.data.concepts = [ConceptConfig(path=str(folder), masks=True)]
    trainer = GenericTrainer(cfg)
    trainer.start()
    try:
        batch = next(iter(trainer.loader))
        assert torch.equal(batch["masks"][..., 4:], torch.zeros_like(batch["masks"][..., 4:]))
        objective = trainer.objective
        plain_target = objective.target

        def gradients(poison: float):
            objective.target = lambda latents, draw: _poisoned(plain_target(latents, draw), poison)
            trainer.model.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(batch, micro=0)
            loss.backward()
            return loss.detach(), [p.grad.clone() for p in trainer.trainable_params()]

        loss, grads = gradients(0.0)
        poisoned_loss, poisoned_grads = gradients(1e3)
        assert torch.isfinite(loss) and loss > 0
        assert torch.equal(poisoned_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, poisoned_grads))
    finally:
        objective.target = plain_target
        trainer.teardown()


def _poisoned(target: torch.Tensor, value: float) -> torch.Tensor:
    if value == 0.0:
        return target
    target = target.clone()
    target[..., target.shape[-1] // 2:] = value
    return target
