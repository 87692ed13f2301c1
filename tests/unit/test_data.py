"""Data pipeline: captions, concept scan, buckets, crops, cache invalidation and sharing, dataset,
DataLoader, demo dataset. Fake encoders stand in for the VAE and text encoder: no model is loaded."""
import logging
import os
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

from modules.config.train_config import ConceptConfig, DataConfig
from modules.data import (BucketBatchSampler, EmptyDatasetError, build_dataset, closest_bucket, collate,
                          ensure_demo_dataset, load_pixels, make_buckets, make_dataloader, plan_crop,
                          process_caption, read_caption, resolve_concept_path, scan_concepts,
                          text_cache_allowed)
from tests.patience import patience

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class FakeEncoders:
    """Latents = 8x average pool with a 4th (mean) channel; text = caption length features."""

    def __init__(self):
        self.image_calls = 0
        self.images = 0
        self.texts = []

    def encode_images(self, pixels):
        assert pixels.dim() == 4 and pixels.shape[1] == 3 and pixels.min() >= -1 and pixels.max() <= 1
        self.image_calls += 1
        self.images += pixels.shape[0]
        pooled = F.avg_pool2d(pixels, 8)
        return torch.cat([pooled, pooled.mean(dim=1, keepdim=True)], dim=1)

    def encode_text(self, captions):
        self.texts.extend(captions)
        lengths = torch.tensor([[float(len(c))] for c in captions])
        return {"encoder_hidden_states": lengths.repeat(1, 6).view(-1, 2, 3), "pooled": lengths}


def write_image(path: Path, size=(64, 64), colour=(200, 30, 30), caption: str | None = None):
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, colour)
    img.putpixel((1, 1), (0, 0, 0))  # not mirror-symmetric, so flips are visible
    img.save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "images"
    write_image(root / "red_square.png", caption="a red square, red, square")
    write_image(root / "blue_thing.png", colour=(20, 20, 200))  # caption from the file name
    write_image(root / "wide.png", size=(96, 64), colour=(20, 200, 20), caption="a wide green picture")
    write_image(root / "tall.jpg", size=(64, 96), colour=(200, 200, 20), caption="a tall yellow picture")
    write_image(root / "sub" / "nested.png", colour=(90, 90, 90), caption="a nested grey square")
    return root


def data_cfg(*folders, **overrides) -> DataConfig:
    cfg = DataConfig(concepts=[ConceptConfig(path=str(f)) for f in folders], resolution=64, bucket_step=16,
                     num_workers=0)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


# -- captions ------------------------------------------------------------------------------------

def test_caption_file_else_file_name(folder):
    assert read_caption(folder / "red_square.png") == "a red square, red, square"
    assert read_caption(folder / "blue_thing.png") == "blue thing"
    (folder / "red_square.caption").write_text("other caption")
    assert read_caption(folder / "red_square.png", ".caption") == "other caption"


def test_tag_shuffle_keeps_leading_tags_and_is_reproducible():
    caption = "trigger, style, a, b, c, d, e, f"
    results = {process_caption(caption, random.Random(seed), shuffle_tags=True, keep_tags=2) for seed in range(20)}
    assert len(results) > 1
    for result in results:
        tags = result.split(", ")
        assert tags[:2] == ["trigger", "style"] and sorted(tags[2:]) == ["a", "b", "c", "d", "e", "f"]
    assert (process_caption(caption, random.Random(3), shuffle_tags=True, keep_tags=2)
            == process_caption(caption, random.Random(3), shuffle_tags=True, keep_tags=2))
    assert process_caption(caption, random.Random(0)) == caption


def test_prefix_and_suffix_stay_outside_the_shuffle_with_any_separator():
    caption = "smiling | red scarf | outdoors | snow"
    for seed in range(10):
        result = process_caption(caption, random.Random(seed), shuffle_tags=True, keep_tags=1, prefix="ohwx person",
                                 suffix="best quality", separator="|")
        tags = result.split("| ")
        assert tags[0] == "ohwx person" and tags[1] == "smiling" and tags[-1] == "best quality"
        assert sorted(tags[2:-1]) == ["outdoors", "red scarf", "snow"]
    assert len({process_caption(caption, random.Random(s), shuffle_tags=True, separator="|") for s in range(10)}) > 1
    assert process_caption("a cat", random.Random(0), prefix="ohwx", suffix="photo") == "ohwx, a cat, photo"
    assert process_caption("", random.Random(0), prefix="ohwx") == "ohwx"
    assert process_caption("a cat", random.Random(0), prefix="  ") == "a cat"
    # Caption dropout drops the trigger word too (kohya does the same): the unconditional case stays empty.
    assert {process_caption("a cat", random.Random(s), dropout=0.5, prefix="ohwx") for s in range(40)} == {
        "", "ohwx, a cat"}


def test_an_empty_tag_separator_is_refused():
    from modules.config import TrainConfig, validate
    cfg = TrainConfig()
    cfg.data.tag_separator = ""
    assert validate(cfg, check_paths=False) == []  # unused: no shuffle, no prefix or suffix
    cfg.data.shuffle_tags = True
    assert any(p.startswith('data.tag_separator: "" cannot split') for p in validate(cfg, check_paths=False))


def test_caption_dropout():
    drops = [process_caption("x", random.Random(seed), dropout=0.5) for seed in range(200)]
    assert 50 < drops.count("") < 150 and set(drops) == {"", "x"}
    assert process_caption("x", random.Random(0), dropout=1.0) == ""


# -- scan ----------------------------------------------------------------------------------------

def test_recursive_scan_repeats_and_disabled_concepts(folder, tmp_path):
    other = tmp_path / "other"
    write_image(other / "one.png", caption="one")
    concepts = [ConceptConfig(path=str(folder), repeats=3), ConceptConfig(path=str(other), enabled=False)]
    scan = scan_concepts(concepts)
    names = sorted(im.path.name for im in scan.images)
    assert names == ["blue_thing.png", "nested.png", "red_square.png", "tall.jpg", "wide.png"]
    assert len(scan.item_images) == 15 and sorted(set(scan.item_images)) == list(range(5))

    flat = scan_concepts([ConceptConfig(path=str(folder), recursive=False)])
    assert "nested.png" not in [im.path.name for im in flat.images] and len(flat.images) == 4


def test_corrupt_image_skipped_with_one_warning_naming_it(folder, caplog):
    (folder / "broken.png").write_bytes(b"not an image at all")
    good = (folder / "red_square.png").read_bytes()
    (folder / "truncated.png").write_bytes(good[: len(good) // 2])
    (folder / "empty.jpg").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        dataset = build_dataset(data_cfg(folder), folder / "cache", seed=0)
    assert len(dataset) == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    per_file = [w for w in warnings if w.startswith("Skipping unreadable image")]
    assert len(per_file) == 3
    assert sum("broken.png" in w for w in per_file) == 1 and sum("truncated.png" in w for w in per_file) == 1
    # The reason, not PIL's name of the in-memory buffer it was handed.
    assert not any("BytesIO" in w for w in warnings)
    assert any("broken.png" in w and "not an image format" in w for w in per_file)
    assert any("truncated.png" in w and "damaged or cut short" in w for w in per_file)
    assert any("empty.jpg" in w and "empty" in w.split(":")[-1] for w in per_file)
    # Then one count, last.
    assert warnings[-1] == f"Skipped 3 unreadable image(s) of 8 in {folder} (each named above)."
    assert len(warnings) == 4


def test_the_scan_reads_images_on_several_threads_and_reports_them_in_file_order(tmp_path, monkeypatch, caplog):
    """The scan is on the path to every start: it reads images on `scan_threads()` threads, and what it finds
    (records, warnings) comes in the folder's sorted order whichever thread read which image."""
    import threading
    import time

    from modules.data import concepts

    names = [f"{i:02d}.png" for i in range(12)]
    for i, name in enumerate(names):
        write_image(tmp_path / "many" / name, size=(32 + 8 * i, 32), caption=f"image {i}")
    for name in ("03.png", "08.png"):
        (tmp_path / "many" / name).write_bytes(b"not an image")
    readers = set()
    real_image_info = concepts._image_info

    def slow_image_info(path):
        readers.add(threading.current_thread().name)
        time.sleep(0.02 if int(path.stem) % 2 else 0.1)  # later files often finish first
        return real_image_info(path)

    monkeypatch.setattr(concepts, "_image_info", slow_image_info)
    monkeypatch.setattr(concepts, "scan_threads", lambda: 4)
    with caplog.at_level(logging.WARNING):
        scan = scan_concepts([ConceptConfig(path=str(tmp_path / "many"))])
    assert len(readers) > 1 and threading.current_thread().name not in readers
    kept = [n for n in names if n not in ("03.png", "08.png")]
    assert [im.path.name for im in scan.images] == kept
    assert [im.width for im in scan.images] == [32 + 8 * int(n[:2]) for n in kept]
    assert [im.caption for im in scan.images] == [f"image {int(n[:2])}" for n in kept]
    per_file = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipping unreadable image")]
    assert [w.split(": ")[0].rsplit("/", 1)[-1] for w in per_file] == ["03.png", "08.png"]
    assert 1 <= concepts.scan_threads() <= concepts.MAX_SCAN_THREADS


def test_only_unreadable_images_is_an_empty_dataset_that_says_so(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "a.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(EmptyDatasetError, match=r"the 1 image file\(s\) there are unreadable"):
        build_dataset(data_cfg(broken), tmp_path / "cache", seed=0)


@pytest.mark.parametrize("data,encoding,caption", [
    ("caf\u00e9 cr\u00e8me, \u201cquoted\u201d".encode("cp1252"), "cp1252", "caf\u00e9 cr\u00e8me, \u201cquoted\u201d"),
    (b"a \x81 byte cp1252 lacks", "latin-1", "a \x81 byte cp1252 lacks"),
])
def test_caption_that_is_not_utf8_is_read_with_a_fallback_and_one_warning(tmp_path, caplog, data, encoding, caption):
    """A non-UTF-8 caption file aborted the launch with a bare UnicodeDecodeError naming no file."""
    write_image(tmp_path / "pic.png")
    (tmp_path / "pic.txt").write_bytes(data)
    with caplog.at_level(logging.WARNING):
        assert read_caption(tmp_path / "pic.png") == caption
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(tmp_path / "pic.txt") in warning and f"read it as {encoding}" in warning and "\n" not in warning


def test_utf8_caption_with_byte_order_mark(tmp_path, caplog):
    write_image(tmp_path / "pic.png")
    (tmp_path / "pic.txt").write_bytes("\ufeffa red square\n".encode("utf-8"))
    with caplog.at_level(logging.WARNING):
        assert read_caption(tmp_path / "pic.png") == "a red square"
    assert not caplog.records


def test_empty_dataset_error_names_the_folders(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    with pytest.raises(EmptyDatasetError, match="empty"):
        build_dataset(data_cfg(empty), tmp_path / "cache", seed=0)
    with pytest.raises(FileNotFoundError, match="missing"):
        build_dataset(data_cfg(tmp_path / "missing"), tmp_path / "cache", seed=0)


# -- buckets and crops ---------------------------------------------------------------------------

def test_buckets_for_square_landscape_and_portrait():
    buckets = make_buckets(512, 64)
    assert (512, 512) in buckets
    for w, h in buckets:
        assert w % 64 == 0 and h % 64 == 0 and w * h <= 512 * 512 and w * h >= 0.8 * 512 * 512
        assert max(w, h) / min(w, h) <= 2.0
    assert buckets[closest_bucket(1000, 1000, buckets)] == (512, 512)
    wide = buckets[closest_bucket(1920, 1080, buckets)]
    tall = buckets[closest_bucket(1080, 1920, buckets)]
    assert wide[0] > wide[1] and tall == (wide[1], wide[0])
    assert abs(wide[0] / wide[1] - 16 / 9) < 0.2
    assert make_buckets(512, 64, aspect_bucketing=False) == [(512, 512)]
    with pytest.raises(ValueError, match="bucket_step"):
        make_buckets(512, 12)


def test_bucket_size_bounds_drop_the_buckets_outside_them():
    every = make_buckets(1024, 64)
    bounded = make_buckets(1024, 64, min_side=768, max_side=1280)
    assert (1024, 1024) in bounded and set(bounded) < set(every)
    assert all(768 <= min(w, h) and max(w, h) <= 1280 for w, h in bounded)
    assert [wh for wh in every if 768 <= min(wh) and max(wh) <= 1280] == bounded
    assert min(min(wh) for wh in every) < 768 and max(max(wh) for wh in every) > 1280  # both bounds removed some
    wide = bounded[closest_bucket(3000, 1000, bounded)]
    assert wide == max(bounded, key=lambda wh: wh[0] / wh[1])  # a panorama takes the widest bucket left
    assert make_buckets(1024, 64, aspect_bucketing=False, min_side=2048) == [(1024, 1024)]
    with pytest.raises(ValueError, match="min_bucket_size=1088.*square bucket"):
        make_buckets(1024, 64, min_side=1088)


def test_bucket_size_bounds_are_checked_against_the_resolution_and_step():
    from modules.config import TrainConfig, validate
    cfg = TrainConfig()
    cfg.data.resolution, cfg.data.min_bucket_size, cfg.data.max_bucket_size = 512, 320, 1024
    assert validate(cfg, check_paths=False) == []
    cfg.data.min_bucket_size, cfg.data.max_bucket_size = 576, 448
    problems = validate(cfg, check_paths=False)
    assert any(p.startswith("data.min_bucket_size: 576 is above data.resolution (512)") for p in problems)
    assert any(p.startswith("data.max_bucket_size: 448 is below data.resolution (512)") for p in problems)
    cfg.data.min_bucket_size, cfg.data.max_bucket_size = 300, 0
    assert any("data.min_bucket_size: 300 is not a multiple of data.bucket_step (64); set it to 320"
               in p for p in validate(cfg, check_paths=False))


def test_bucket_size_bounds_reach_the_dataset(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (300, 100)).save(folder / "pano.png")
    free = build_dataset(data_cfg(folder, resolution=128, bucket_step=16), tmp_path / "c", 0)
    bounded = build_dataset(data_cfg(folder, resolution=128, bucket_step=16, min_bucket_size=112), tmp_path / "c", 0)
    assert min(free.bucket_sizes[free.buckets[0]]) < 112
    assert bounded.bucket_sizes[bounded.buckets[0]] == max(bounded.bucket_sizes, key=lambda wh: wh[0] / wh[1])
    assert min(bounded.bucket_sizes[bounded.buckets[0]]) >= 112


def test_crop_plan_covers_the_bucket_and_records_sizes():
    plan = plan_crop(200, 100, (64, 64))
    assert plan.original_size == (100, 200) and plan.resized_size == (64, 128)
    assert plan.crop_top_left == (0, 32) and plan.target_size == (64, 64)
    rng_plans = {plan_crop(200, 100, (64, 64), random.Random(s)).crop_top_left for s in range(10)}
    assert len(rng_plans) > 1 and all(0 <= left <= 64 for _, left in rng_plans)
    skewed = plan_crop(200, 100, (64, 64), random.Random(1))
    from dataclasses import replace
    mirrored = replace(skewed, flip=True)
    assert mirrored.crop_coords == (0, 64 - skewed.crop_top_left[1])


def test_load_pixels_range_shape_and_flip(folder):
    plan = plan_crop(96, 64, (80, 48))
    pixels = load_pixels(folder / "wide.png", plan)
    assert pixels.shape == (3, 48, 80) and pixels.min() >= -1 and pixels.max() <= 1
    from dataclasses import replace
    flipped = load_pixels(folder / "wide.png", replace(plan, flip=True))
    assert torch.equal(flipped, pixels.flip(-1)) and not torch.equal(flipped, pixels)


def test_dataset_assigns_buckets_by_shape(folder):
    dataset = build_dataset(data_cfg(folder), folder / "cache", seed=0)
    by_name = {dataset.images[j].path.name: dataset.bucket_sizes[dataset.buckets[i]]
               for i, j in enumerate(dataset.item_images)}
    assert by_name["red_square.png"] == (64, 64)
    assert by_name["wide.png"][0] > by_name["wide.png"][1]
    assert by_name["tall.jpg"][0] < by_name["tall.jpg"][1]
    one = build_dataset(data_cfg(folder, aspect_bucketing=False), folder / "cache", seed=0)
    assert set(one.buckets) == {0} and one.bucket_sizes == [(64, 64)]


# -- cache ---------------------------------------------------------------------------------------

def cache(dataset, enc, fingerprint="model-a", rank=0, world=1, text=True):
    return dataset.cache(enc.encode_images, enc.encode_text, fingerprint, rank=rank, world_size=world,
                         cache_text=text, progress=False)


def test_cache_reused_and_invalidated_entry_by_entry(folder, tmp_path):
    cache_dir = tmp_path / "cache"
    first = FakeEncoders()
    cache(build_dataset(data_cfg(folder), cache_dir, 0), first)
    assert first.images == 5 and len(first.texts) == 5

    again = FakeEncoders()
    cache(build_dataset(data_cfg(folder), cache_dir, 0), again)
    assert again.image_calls == 0 and again.texts == []

    write_image(folder / "wide.png", size=(96, 64), colour=(1, 2, 3), caption="a wide green picture")
    (folder / "tall.txt").write_text("a new caption", encoding="utf-8")
    edited = FakeEncoders()
    cache(build_dataset(data_cfg(folder), cache_dir, 0), edited)
    assert edited.images == 1 and edited.texts == ["a new caption"]

    other_model = FakeEncoders()
    cache(build_dataset(data_cfg(folder), cache_dir, 0), other_model, fingerprint="model-b")
    assert other_model.images == 5 and len(other_model.texts) == 5

    other_resolution = FakeEncoders()
    cache(build_dataset(data_cfg(folder, resolution=128), cache_dir, 0), other_resolution)
    assert other_resolution.images == 5 and other_resolution.texts == []


def test_cache_written_by_two_ranks_is_complete_and_reused_by_one(folder, tmp_path):
    cache_dir = tmp_path / "cache"
    cfg = data_cfg(folder)
    rank_encoders = [FakeEncoders(), FakeEncoders()]
    for rank, enc in enumerate(rank_encoders):
        index = cache(build_dataset(cfg, cache_dir, 0), enc, rank=rank, world=2)
    assert [e.images for e in rank_encoders] == [3, 2]
    assert not set(rank_encoders[0].texts) & set(rank_encoders[1].texts)
    assert index.missing() == []
    single = FakeEncoders()
    dataset = build_dataset(cfg, cache_dir, 0)
    cache(dataset, single, world=1)
    assert single.image_calls == 0 and single.texts == []
    # What the ranks stored is what the encoder gives for the item's pixels.
    item = dataset[2]
    plan_pixels = load_pixels(dataset.images[dataset.item_images[2]].path, dataset._fixed_plan(dataset.item_images[2]))
    assert torch.allclose(item["latents"], FakeEncoders().encode_images(plan_pixels[None])[0])


def test_cache_of_many_batches_matches_the_images_and_stops_on_a_failed_write(tmp_path, monkeypatch):
    """Decoding runs ahead on threads and writing behind on another: every entry still belongs to its
    image, and a write error stops caching with that error (no hang, no silent gap)."""
    from modules.data import cache as cache_module

    root = tmp_path / "many"
    for i in range(40):
        write_image(root / f"{i:02d}.png", colour=(i * 6, 255 - i * 6, 100), caption=f"picture {i}")
    cfg = data_cfg(root, aspect_bucketing=False)
    dataset = build_dataset(cfg, tmp_path / "cache", 0)
    enc = FakeEncoders()
    dataset.cache(enc.encode_images, None, "model-a", cache_text=False, batch_size=3, progress=False)
    assert enc.images == 40 and enc.image_calls == 14
    for index in (0, 17, 39):
        image_index = dataset.item_images[index]
        pixels = load_pixels(dataset.images[image_index].path, dataset._fixed_plan(image_index))
        assert torch.allclose(dataset[index]["latents"], FakeEncoders().encode_images(pixels[None])[0])

    calls = {"n": 0}
    real_write = cache_module._write_atomic

    def disk_full_on_fifth(tensors, path):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full (simulated)")
        real_write(tensors, path)

    monkeypatch.setattr(cache_module, "_write_atomic", disk_full_on_fifth)
    fresh = build_dataset(cfg, tmp_path / "other-cache", 0)
    with pytest.raises(OSError, match="simulated"):
        fresh.cache(FakeEncoders().encode_images, None, "model-a", cache_text=False, batch_size=3, progress=False)


class FakeDistributionEncoder:
    """Like the VAE: a distribution per image (mean = the fake latents, std = a quarter of |mean| + 0.1);
    records the batches it was given."""

    def __init__(self):
        self.batches: list[list[float]] = []

    def encode(self, pixels):
        mean = FakeEncoders().encode_images(pixels)
        self.batches.append(sorted(round(float(p.sum()), 3) for p in pixels))
        return mean, mean.abs() / 4 + 0.1


def test_cached_distribution_is_sampled_per_item_and_epoch_whoever_built_or_loads_it(folder, tmp_path):
    """The cache keeps the latent distribution; the sample depends on (seed, epoch, item) only."""
    for i in range(12):
        write_image(folder / "more" / f"{i}.png", colour=(10 * i, 50, 90), caption=f"more {i}")
    cfg = data_cfg(folder, random_flip=True)
    by_one = build_dataset(cfg, tmp_path / "one", seed=3)
    by_one.cache(FakeDistributionEncoder().encode, None, "model-a", progress=False)
    by_two = build_dataset(cfg, tmp_path / "two", seed=3)
    for rank in (0, 1):
        by_two.cache(FakeDistributionEncoder().encode, None, "model-a", rank=rank, world_size=2, progress=False)
    for name in (p.name for p in (tmp_path / "one" / "latents").iterdir()):
        assert (tmp_path / "one" / "latents" / name).read_bytes() == (tmp_path / "two" / "latents" / name).read_bytes()
    index = 4
    first = by_one[(0, index)]["latents"]
    assert torch.equal(first, by_two[(0, index)]["latents"]) and torch.equal(first, by_one[(0, index)]["latents"])
    assert not torch.equal(first, by_one[(1, index)]["latents"]), "each epoch draws a new sample"
    # A DataLoader worker draws what the main process draws.
    sampler = BucketBatchSampler(by_one.buckets, 2, seed=3)
    loaded = {int(i): lat for batch in make_dataloader(by_one, sampler, data_cfg(folder, num_workers=2), False)
              for i, lat in zip(batch["indices"], batch["latents"])}
    assert all(torch.equal(lat, by_one[(0, i)]["latents"]) for i, lat in loaded.items())
    entry = load_file(str(by_one._cache.latent_files[by_one.item_images[index]]))
    assert set(entry) == {"mean", "std", "mean_flipped", "std_flipped"}
    # The samples follow the stored distribution (without flips, so that every draw is of one of them).
    plain = build_dataset(data_cfg(folder), tmp_path / "plain", seed=3)
    plain.cache(FakeDistributionEncoder().encode, None, "model-a", progress=False)
    entry = load_file(str(plain._cache.latent_files[plain.item_images[index]]))
    draws = torch.stack([plain[(epoch, index)]["latents"] for epoch in range(400)])
    assert torch.allclose(draws.mean(0), entry["mean"], atol=0.05)
    assert torch.allclose(draws.std(0), entry["std"], rtol=0.2)


def test_cache_batches_do_not_depend_on_the_number_of_ranks(tmp_path):
    """An entry's batch-mates decide a kernel's rounding: batches are cut from the data, whole batches
    go to ranks, so 1 and 3 ranks encode the very same batches."""
    root = tmp_path / "imgs"
    for i in range(21):
        write_image(root / f"{i:02d}.png", size=(64, 64) if i % 3 else (96, 64), colour=(i * 11, 9, 9))
    cfg = data_cfg(root)
    alone = FakeDistributionEncoder()
    build_dataset(cfg, tmp_path / "c1", 0).cache(alone.encode, None, "m", batch_size=4, progress=False)
    ranks = [FakeDistributionEncoder() for _ in range(3)]
    for rank, enc in enumerate(ranks):
        build_dataset(cfg, tmp_path / "c3", 0).cache(enc.encode, None, "m", rank=rank, world_size=3, batch_size=4,
                                                     progress=False)
    assert sorted(alone.batches) == sorted(b for enc in ranks for b in enc.batches)
    assert sorted(sum(len(b) for b in enc.batches) for enc in ranks) == [6, 7, 8]  # shared out evenly


def test_text_cache_refused_when_captions_change_per_use(folder, tmp_path):
    cfg = data_cfg(folder, shuffle_tags=True)
    assert not text_cache_allowed(cfg, train_text_encoder=False)
    assert text_cache_allowed(data_cfg(folder), train_text_encoder=False)
    assert not text_cache_allowed(data_cfg(folder), train_text_encoder=True)
    with pytest.raises(ValueError, match="shuffle_tags"):
        cache(build_dataset(cfg, tmp_path / "cache", 0), FakeEncoders())


def test_text_cached_with_caption_dropout_gives_the_captions_and_embeddings_of_an_uncached_run(folder, tmp_path):
    """Caption dropout trains on the empty caption instead of an image's: cached once beside the captions,
    so the text encoder need not run each step; every use draws the same caption as without the cache."""
    cfg = data_cfg(folder, caption_dropout=0.4)
    assert text_cache_allowed(cfg, train_text_encoder=False)
    cached = build_dataset(cfg, tmp_path / "cache", seed=3)
    enc = FakeEncoders()
    index = cache(cached, enc)
    assert enc.texts.count("") == 1 and len(index.missing()) == 0  # the empty caption, encoded once
    uncached = build_dataset(cfg, tmp_path / "cache", seed=3)
    cache(uncached, FakeEncoders(), text=False)
    own, empty = FakeEncoders().encode_text, FakeEncoders().encode_text([""])
    dropped = 0
    for epoch in range(8):
        for i in range(len(cached)):
            item, plain = cached[(epoch, i)], uncached[(epoch, i)]
            assert item["caption"] == plain["caption"]
            expected = own([item["caption"]])
            assert all(torch.equal(item["text"][k], expected[k][0]) for k in expected)
            dropped += item["caption"] == "" != cached.images[cached.item_images[i]].caption
    assert 0 < dropped < 8 * len(cached)
    assert torch.equal(index.load_extra_text("")["pooled"], empty["pooled"][0])


def test_cached_text_holds_the_caption_with_its_prefix_and_suffix(folder, tmp_path):
    """A trigger word is a fixed part of each caption: cached once, and the cached embedding is the one of
    the caption as trained; another prefix is another cache entry."""
    cfg = data_cfg(folder, caption_prefix="ohwx", caption_suffix="end", caption_dropout=0.3)
    dataset = build_dataset(cfg, tmp_path / "cache", seed=2)
    enc = FakeEncoders()
    cache(dataset, enc)
    assert "ohwx, a red square, red, square, end" in enc.texts and "a red square, red, square" not in enc.texts
    own = FakeEncoders().encode_text
    seen = set()
    for epoch in range(6):
        for i in range(len(dataset)):
            item = dataset[(epoch, i)]
            seen.add(item["caption"] == "")
            assert item["caption"] == "" or (item["caption"].startswith("ohwx, ") and item["caption"].endswith(", end"))
            expected = own([item["caption"]])
            assert all(torch.equal(item["text"][k], expected[k][0]) for k in expected)
    assert seen == {True, False}
    other = FakeEncoders()
    cache(build_dataset(data_cfg(folder, caption_prefix="sks"), tmp_path / "cache", seed=2), other)
    assert any(text.startswith("sks, ") for text in other.texts)


def test_shuffled_captions_are_not_cached_and_the_reason_is_given(folder):
    from modules.data import text_cache_refusal
    assert "shuffle_tags" in text_cache_refusal(data_cfg(folder, shuffle_tags=True), False)
    assert "text encoder trains" in text_cache_refusal(data_cfg(folder), True)
    assert text_cache_refusal(data_cfg(folder), False) is None
    assert text_cache_refusal(data_cfg(folder, shuffle_tags=True, cache_text_embeddings=False), False) is None


def test_no_extra_caption_without_caption_dropout(folder, tmp_path):
    enc = FakeEncoders()
    index = cache(build_dataset(data_cfg(folder), tmp_path / "cache", 0), enc)
    assert "" not in enc.texts and index.extra_text_files == {}


# -- dataset items, batches, loader --------------------------------------------------------------

def test_items_and_collate_with_cached_latents_and_text(folder, tmp_path):
    dataset = build_dataset(data_cfg(folder, random_flip=True), tmp_path / "cache", seed=1)
    enc = FakeEncoders()
    cache(dataset, enc)
    assert enc.images == 10, "both flips are cached with random_flip"
    square = [i for i, b in enumerate(dataset.buckets) if dataset.bucket_sizes[b] == (64, 64)]
    batch = collate([dataset[i] for i in square])
    assert batch["latents"].shape == (3, 4, 8, 8)
    assert batch["text"]["encoder_hidden_states"].shape == (3, 2, 3) and batch["text"]["pooled"].shape == (3, 1)
    assert batch["target_sizes"].tolist() == [[64, 64]] * 3 and batch["original_sizes"].dtype == torch.long
    assert batch["crop_coords"].shape == (3, 2) and len(batch["captions"]) == 3
    flips = {bool(torch.equal(dataset[(e, square[0])]["latents"], dataset[(0, square[0])]["latents"]))
             for e in range(12)}
    assert flips == {True, False}, "random flip picks both cached variants across epochs"


def test_pixels_without_cache_and_per_item_randomness(folder, tmp_path):
    cfg = data_cfg(folder, shuffle_tags=True, keep_tags=1, cache_latents=False)
    dataset = build_dataset(cfg, tmp_path / "cache", seed=5)
    red = next(i for i, j in enumerate(dataset.item_images) if dataset.images[j].path.name == "red_square.png")
    item = dataset[(0, red)]
    assert item["pixels"].shape == (3, 64, 64) and "latents" not in item
    assert item["caption"].startswith("a red square")
    assert dataset[(3, red)]["caption"] == build_dataset(cfg, tmp_path / "cache", seed=5)[(3, red)]["caption"]
    captions = {dataset[(epoch, red)]["caption"] for epoch in range(10)}
    assert len(captions) == 2  # "red, square" and "square, red" after the kept tag


def test_dataloader_workers_match_single_process_across_epochs(folder, tmp_path):
    cfg = data_cfg(folder, shuffle_tags=True, caption_dropout=0.3, cache_latents=False, random_flip=True)
    dataset = build_dataset(cfg, tmp_path / "cache", seed=2)
    cfg_workers = data_cfg(folder, shuffle_tags=True, caption_dropout=0.3, cache_latents=False,
                           random_flip=True, num_workers=1, prefetch_factor=1)
    sampler = BucketBatchSampler([0] * len(dataset), batch_size=1, seed=2)
    plain = make_dataloader(dataset, sampler, cfg, device_is_cuda=False)
    workers = make_dataloader(dataset, sampler, cfg_workers, device_is_cuda=False)
    assert not plain.pin_memory and plain.prefetch_factor is None and workers.persistent_workers
    assert not make_dataloader(dataset, sampler, cfg_workers, device_is_cuda=False).pin_memory
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        a, b = list(plain), list(workers)
        assert [x["captions"] for x in a] == [y["captions"] for y in b]
        assert all(torch.equal(x["pixels"], y["pixels"]) for x, y in zip(a, b))
        expected = [dataset[(epoch, int(x["indices"][0]))]["caption"] for x in a]
        assert [x["captions"][0] for x in a] == expected
    assert len(plain) == len(sampler)


# -- demo dataset --------------------------------------------------------------------------------

def test_demo_dataset_is_deterministic_and_resolvable(tmp_path, monkeypatch):
    first = ensure_demo_dataset(tmp_path / "a")
    second = ensure_demo_dataset(tmp_path / "b")
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    pngs = [f for f in files if f.endswith(".png")]
    assert len(pngs) == 64 and len([f for f in files if f.endswith(".txt")]) == 64
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes()
    sizes = {Image.open(first / f).size for f in pngs}
    assert sizes == {(64, 64), (96, 64), (64, 96)}
    caption = (first / pngs[0]).with_suffix(".txt").read_text()
    assert caption.startswith("a ") and "background" in caption
    stamp = (first / pngs[0]).stat().st_mtime_ns
    assert ensure_demo_dataset(tmp_path / "a") == first and (first / pngs[0]).stat().st_mtime_ns == stamp

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    resolved = resolve_concept_path("builtin:demo-shapes")
    assert resolved == tmp_path / "home" / "demo-shapes" and len(list(resolved.glob("*.png"))) == 64
    with pytest.raises(ValueError, match="demo-shapes"):
        resolve_concept_path("builtin:nope")
    dataset = build_dataset(DataConfig(resolution=64, bucket_step=16), tmp_path / "cache", seed=0)
    assert len(dataset) == 64 and len(set(dataset.buckets)) == 3


def test_demo_dataset_built_concurrently_by_several_ranks(tmp_path):
    from concurrent.futures import ThreadPoolExecutor
    root = tmp_path / "shared" / "demo-shapes"
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: ensure_demo_dataset(root), range(3)))
    assert results == [root] * 3
    assert len(list(root.glob("*.png"))) == 64
    assert [p.name for p in root.parent.iterdir()] == ["demo-shapes"], "temporary folders left behind"


def _report_loader_start(rank: int, out: str) -> None:
    """Runs in a rank started by torch.multiprocessing.spawn (the spawn launcher's ranks)."""
    import multiprocessing

    from modules.data.dataset import make_dataloader
    loader = make_dataloader([], [], DataConfig(num_workers=2), device_is_cuda=False)
    Path(out).write_text(f"{multiprocessing.get_start_method()} {loader.multiprocessing_context.get_start_method()}")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forking is Linux's; elsewhere workers spawn")
def test_loader_workers_are_forked_in_a_rank_the_spawn_launcher_started(tmp_path):
    """Such a rank's default start method is spawn, and spawned workers would re-import torch and the model
    libraries before their first batch (seconds on a GPU host): the loader forks them anyway."""
    out = tmp_path / "start-methods"
    torch.multiprocessing.spawn(_report_loader_start, args=(str(out),), nprocs=1)
    assert out.read_text() == "spawn fork"


def test_what_the_scan_leaves_out_or_resizes_is_said_once_each(tmp_path, caplog):
    """1x1 images, one far too large and a link back up the folder trained without a word; each now gets one line."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        Image.new("RGB", (64, 64), (80 * i, 20, 20)).save(data / f"ok{i}.png")
    Image.new("RGB", (1, 1)).save(data / "pixel.png")
    Image.new("RGB", (600, 600), (9, 9, 9)).save(data / "huge.png")
    (data / "loop").symlink_to(data)
    (data / "gone.png").symlink_to(data / "deleted.png")
    cfg = DataConfig(resolution=64, concepts=[ConceptConfig(path=str(data), recursive=True)])
    with caplog.at_level(logging.WARNING):
        dataset = build_dataset(cfg, tmp_path / "cache", seed=0)
    assert len(dataset) == 5  # all of them still train
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"Ignored in {data}: 1 linked folder(s), not followed: loop -> {data.resolve()} (a loop); 1 link(s) to missing "
        "images: gone.png.",
        "1 image(s) are enlarged more than 2x to fill their bucket and will train blurry: pixel.png 1x1 -> 64x64. Use "
        "larger images, or a lower data.resolution.",
        "1 image(s) are shrunk more than 8x to fit their bucket, which decodes them whole at every load (once, with "
        "data.cache_latents): huge.png 600x600 -> 64x64."], warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a scan made already (a launcher's, carried to its workers): no word
        build_dataset(cfg, tmp_path / "cache", seed=0, scan=dataset_scan(dataset))
    assert not caplog.records


def dataset_scan(dataset):
    from modules.data.concepts import ScanResult
    return ScanResult(images=dataset.images, item_images=dataset.item_images, validation=dataset.validation_images)


class _Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        import time
        time.sleep(0.01)
        return torch.tensor([i])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kills a forked worker")
def test_a_dead_loader_worker_is_named_with_how_it_died():
    """The OOM killer's kill -9 of a loader worker shows in the rank as a pipe reset or a RuntimeError from the
    loader's SIGCHLD handler; the rank's error must say which worker died and how."""
    import signal
    from modules.data.dataset import DataLoadingError, loader_worker_context, loading_failure
    loader = torch.utils.data.DataLoader(_Numbers(), batch_size=2, num_workers=1, persistent_workers=True,
                                         multiprocessing_context=loader_worker_context())
    batches = iter(loader)
    next(batches)
    (worker,) = loader._iterator._workers
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(Exception) as raised:
        for _ in range(10_000):
            next(batches)
    failure = loading_failure(loader, raised.value)
    assert isinstance(failure, DataLoadingError)
    assert str(failure) == f"a data loading worker (pid {worker.pid}) of this rank died (SIGKILL)"
    loader._iterator._shutdown_workers()


@pytest.mark.slow  # waits for the loader's 5 s status check
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kills a forked worker")
def test_a_loader_worker_dead_between_epochs_is_named_when_the_next_epoch_starts():
    """A persistent worker that dies between epochs ends the next epoch's `iter` (it waits for every worker to
    take its new order: "DataLoader worker (pid(s) N) exited unexpectedly"), before any batch is taken; the
    rank's error must name it as a dead batch's does."""
    import signal
    from modules.data.dataset import DataLoadingError, loader_worker_context, start_iteration
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, num_workers=1, persistent_workers=True,
                                         multiprocessing_context=loader_worker_context())
    list(start_iteration(loader))  # the first epoch
    (worker,) = loader._iterator._workers
    # As when the loader's SIGCHLD handler has not run yet (it raises wherever the rank is when it does).
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=patience(60))
        with pytest.raises(DataLoadingError) as raised:
            start_iteration(loader)
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert str(raised.value) == f"a data loading worker (pid {worker.pid}) of this rank died (SIGKILL)"
    assert "exited unexpectedly" in str(raised.value.__cause__)
    loader._iterator._shutdown_workers()


def test_a_pipe_reset_read_before_the_dead_worker_can_be_reaped_still_names_it():
    """The killed worker's pipe closes while the kernel is still ending it: the rank can read the reset before the
    worker's exit code exists. The reset waits (up to 2 s) for the exit code instead of blaming the pipe."""
    import threading
    from types import SimpleNamespace
    from modules.data.dataset import loading_failure

    worker = SimpleNamespace(pid=4242, exitcode=None)
    loader = SimpleNamespace(_iterator=SimpleNamespace(_workers=[worker]))
    threading.Timer(0.3, lambda: setattr(worker, "exitcode", -9)).start()
    failure = loading_failure(loader, ConnectionResetError(104, "Connection reset by peer"))
    assert str(failure) == "a data loading worker (pid 4242) of this rank died (SIGKILL)"
    # an error that is not what a dead worker looks like is said as it is, at once
    worker.exitcode = None
    assert str(loading_failure(loader, ValueError("bad caption"))) == "loading a batch failed: ValueError: bad caption"
