"""`TrainDataset`: scanned images in buckets, served from the latent/text cache or as pixels.

Randomness per use (crop position without cached latents, flip, caption dropout, tag shuffle, the
sample of a cached latent distribution) comes from RNGs seeded by (seed, epoch, item index) only, so
an item looks the same whichever rank or DataLoader worker loads it and however many of them there are.
"""
from __future__ import annotations

import functools
import hashlib
import multiprocessing
import os
import random
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from modules.config.train_config import DataConfig
from modules.util.exit import die_with_parent

from .buckets import VAE_FACTOR, CropPlan, closest_bucket, load_pixels, make_buckets, plan_crop
from .cache import CacheIndex, CacheItem, EncodeImages, EncodeText, fill_cache
from .concepts import ImageRecord, ScanResult, process_caption, report_sizes, scan_concepts, with_prefix_and_suffix
from .controls import ControlImage, text_with_controls
from .masks import load_mask, loss_weights
from .video import Window, load_clip


def clip_window(data_cfg: DataConfig) -> Window:
    """The frames a video clip trains on (`data.video_frames` at `data.video_fps`)."""
    return Window(data_cfg.video_frames, data_cfg.video_fps)


def _rng(*parts) -> random.Random:
    return random.Random(":".join(str(p) for p in parts))


def _torch_rng(*parts) -> torch.Generator:
    """A torch generator keyed like `_rng` (a hash of the parts, the same in every process)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)


DROPPED_CAPTION = ""
"""What caption dropout trains on instead of an image's caption; cached once beside the captions."""


def text_cache_allowed(data_cfg: DataConfig, train_text_encoder: bool) -> bool:
    """Whether caption embeddings may be cached: the encoder is frozen and every use of a caption gives
    one of two texts - the caption (with its fixed prefix and suffix), or with caption dropout the empty
    caption (cached once) - which tag shuffling would not (each use a new order)."""
    return text_cache_refusal(data_cfg, train_text_encoder) is None and data_cfg.cache_text_embeddings


def text_cache_refusal(data_cfg: DataConfig, train_text_encoder: bool) -> str | None:
    """Why text embeddings are not cached although `data.cache_text_embeddings` asks for it; None when
    they can be (or are not asked for). kohya refuses the combination; Tandem encodes every step instead."""
    if not data_cfg.cache_text_embeddings:
        return None
    if train_text_encoder:
        return ("data.cache_text_embeddings: not cached, the text encoder trains (its embeddings change every "
                "step); captions are encoded every step.")
    if data_cfg.shuffle_tags:
        return ("data.cache_text_embeddings: not cached, data.shuffle_tags gives each use of a caption another "
                "tag order; captions are encoded every step (turn off Shuffle tags to cache them).")
    return None


class TrainDataset(Dataset):
    """Items are images with repeats expanded; `buckets[i]` is item i's bucket id."""

    def __init__(self, scan: ScanResult, bucket_sizes: list[tuple[int, int]], data_cfg: DataConfig,
                 cache_dir: Path, seed: int):
        self.images: list[ImageRecord] = scan.images
        self.item_images: list[int] = scan.item_images
        self.bucket_sizes = bucket_sizes
        """Bucket id -> (width, height)."""
        self.data_cfg = data_cfg
        self.cache_dir = Path(cache_dir)
        self.seed = seed
        self.epoch = 0
        """Used for plain integer indexes; `make_dataloader` passes the sampler's epoch with each index."""
        self._image_bucket = [closest_bucket(im.width, im.height, bucket_sizes) for im in self.images]
        # A clip's latents have more frames than an image's: clips of a size form buckets of their own (ids
        # after the images'), so a batch never mixes them.
        self.buckets: list[int] = [self._image_bucket[j] + (len(bucket_sizes) if self.images[j].is_clip else 0)
                                   for j in self.item_images]
        self.window = clip_window(data_cfg)
        self.validation_images: list[ImageRecord] = scan.validation
        """Images held out for the validation loss (`validation_set()` serves them)."""
        self.uses_masks = any(im.mask_path is not None for im in self.images)
        """Whether items carry a `mask` (then every item does: all ones for an image without one)."""
        self.control_count = len(self.images[0].controls) if self.images else 0
        """Control images per item (an edit model's pairs; `concepts.scan_concepts` makes it the same for all)."""
        self.text_sees_controls = False
        """Whether the model's text encoder reads each caption with its pair's controls (Qwen-Image-Edit's): the
        trainer says so from the family, and the texts then carry them (`controls.text_with_controls`)."""
        self._cache: CacheIndex | None = None
        self._control_slots: list[list[int]] = []
        """Per image, the cache items of its controls (after the images' own)."""
        self._text_cached = False
        self._latents_cached = False

    def __len__(self) -> int:
        return len(self.item_images)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def validation_set(self) -> "TrainDataset | None":
        """The held-out images as a dataset of one item each, without any random augmentation (no flip, no
        random crop, no caption dropout or tag shuffling), so an item looks the same at every evaluation;
        None when nothing is held out."""
        if not self.validation_images:
            return None
        fixed = replace(self.data_cfg, random_flip=False, random_crop=False, caption_dropout=0.0, shuffle_tags=False)
        scan = ScanResult(images=list(self.validation_images), item_images=list(range(len(self.validation_images))))
        held_out = TrainDataset(scan, self.bucket_sizes, fixed, self.cache_dir, self.seed)
        held_out.text_sees_controls = self.text_sees_controls
        return held_out

    def scan(self) -> ScanResult:
        """The scan this dataset was made from (a launcher's, handed to its workers)."""
        return ScanResult(images=list(self.images), item_images=list(self.item_images),
                          validation=list(self.validation_images))

    def describe_roles(self) -> str:
        """One start-up line: training, regularisation and held-out images, masks."""
        counts = {role: sum(im.role == role for im in self.images) for role in ("train", "regularisation")}
        items = {role: sum(self.images[i].role == role for i in self.item_images) for role in counts}
        parts = [f"{counts['train']} training images ({items['train']} items per epoch)"]
        if counts["regularisation"]:
            parts.append(f"{counts['regularisation']} regularisation images ({items['regularisation']} items per "
                         "epoch, mixed evenly into every global batch)")
        masked = sum(im.mask_path is not None for im in self.images)
        if masked:
            parts.append(f"{masked} with masks")
        if self.control_count:
            parts.append(f"each with {self.control_count} control image(s)")
        parts.append(f"{len(self.validation_images)} held out for the validation loss" if self.validation_images
                     else "no validation set")
        return ", ".join(parts)

    def item_groups(self) -> list[int] | None:
        """Each item's group for the sampler's balancing (training / regularisation); None without the latter."""
        from .roles import item_groups
        return item_groups(self.images, self.item_images)

    def texts_to_cache(self) -> list[str]:
        """Every text whose embedding this dataset's text cache holds: the images' captions, and the dropped
        caption when captions drop out."""
        texts = [self.text_of(image) for image in [*self.images, *self.validation_images]]
        if self.data_cfg.caption_dropout > 0.0:
            texts.append(DROPPED_CAPTION)
        return list(dict.fromkeys(texts))

    def text_of(self, image: ImageRecord, caption: str | None = None) -> str:
        """The text the model encodes for `image` (its full caption unless `caption` is given): with its controls
        when the text encoder sees them."""
        caption = self.full_caption(image) if caption is None else caption
        return text_with_controls(caption, image.controls) if self.text_sees_controls and image.controls else caption

    def clip_paths(self) -> list[Path]:
        """The video clips among the images (a family that trains images only refuses them)."""
        return [image.path for image in [*self.images, *self.validation_images] if image.is_clip]

    def _frames(self, image_index: int) -> tuple[int, ...]:
        """A clip's window of source frames (fixed by its content and the seed); () for an image."""
        image = self.images[image_index]
        if not image.is_clip:
            return ()
        return self.window.indices(image.frame_count, image.frame_rate, _rng(self.seed, "window", image.content_hash))

    def _pixels(self, image_index: int, plan: CropPlan) -> torch.Tensor:
        image = self.images[image_index]
        if image.is_clip:
            return load_clip(image.path, plan, self._frames(image_index))
        return load_pixels(image.path, plan)

    @property
    def latents_cached(self) -> bool:
        return self._latents_cached

    def _fixed_plan(self, image_index: int, control: ControlImage | None = None) -> CropPlan:
        """The crop used for cached latents: centre, or a random spot fixed per image content. A control image
        takes its target's bucket and the same draw, so a pair of one size is cropped alike."""
        image = self.images[image_index]
        bucket = self.bucket_sizes[self._image_bucket[image_index]]
        rng = _rng(self.seed, "crop", image.content_hash) if self.data_cfg.random_crop else None
        source = control or image
        return plan_crop(source.width, source.height, bucket, rng)

    def cache(self, encode_images: EncodeImages | None, encode_text: EncodeText | None, fingerprint: str,
              rank: int = 0, world_size: int = 1, cache_text: bool = False, batch_size: int = 8,
              progress: bool = True) -> CacheIndex:
        """Fill this rank's share of the cache (latents if `data.cache_latents`, text if `cache_text`).

        Call a barrier afterwards: items are then read from entries any rank wrote.
        """
        cfg = self.data_cfg
        if cache_text and cfg.shuffle_tags:
            raise ValueError("Text embeddings cannot be cached with data.shuffle_tags on (each use gives another "
                             "caption); pass cache_text=False (see text_cache_allowed()).")
        items = [CacheItem(image_path=im.path, content_hash=im.content_hash, plan=self._fixed_plan(j),
                           with_flipped=cfg.random_flip, caption=self.text_of(im) if cache_text else None,
                           mask_path=im.mask_path, mask_hash=im.mask_hash, frames=self._frames(j))
                 for j, im in enumerate(self.images)]
        # Control latents are cached as images of their own, after the targets: shared out over the ranks alike.
        self._control_slots = []
        for j, im in enumerate(self.images):
            self._control_slots.append(list(range(len(items), len(items) + len(im.controls))))
            items += [CacheItem(image_path=c.path, content_hash=c.content_hash, plan=self._fixed_plan(j, c),
                                with_flipped=cfg.random_flip) for c in im.controls]
        self._cache = fill_cache(items, encode_images if cfg.cache_latents else None,
                                 encode_text if cache_text else None, fingerprint, self.cache_dir,
                                 rank=rank, world_size=world_size, batch_size=batch_size, progress=progress,
                                 extra_captions=[DROPPED_CAPTION] if cfg.caption_dropout > 0.0 else [])
        self._text_cached = cache_text
        self._latents_cached = cfg.cache_latents and encode_images is not None
        return self._cache

    def _control_pixels(self, image_index: int, control: ControlImage, crop_draw: tuple, flip: bool) -> torch.Tensor:
        """A control image cropped to its target's bucket with the target's crop draw (`crop_draw`, the RNG state
        before it) and flipped with it."""
        if not self.data_cfg.random_crop:
            return load_pixels(control.path, replace(self._fixed_plan(image_index, control), flip=flip))
        rng = random.Random()
        rng.setstate(crop_draw)
        bucket = self.bucket_sizes[self._image_bucket[image_index]]
        return load_pixels(control.path, replace(plan_crop(control.width, control.height, bucket, rng), flip=flip))

    def full_caption(self, image: ImageRecord) -> str:
        """The image's caption with the fixed prefix and suffix: what a use without dropout or shuffling trains on."""
        cfg = self.data_cfg
        return with_prefix_and_suffix(image.caption, cfg.caption_prefix, cfg.caption_suffix, cfg.tag_separator)

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        epoch, index = key if isinstance(key, tuple) else (self.epoch, key)
        image_index = self.item_images[index]
        image = self.images[image_index]
        cfg = self.data_cfg
        # Draw in a fixed order (crop, flip, caption) so each draw means the same on every run.
        rng = _rng(self.seed, epoch, index)
        item: dict = {"index": index}
        if self.latents_cached:
            plan = self._fixed_plan(image_index)
            flip = cfg.random_flip and rng.random() < 0.5
            plan = replace(plan, flip=flip)
            item["latents"] = self._cache.load_latents(image_index, flipped=flip,
                                                       generator=_torch_rng(self.seed, "latents", epoch, index))
            mask = self._cache.load_mask(image_index, flipped=flip) if self.uses_masks else None
            if self.control_count:
                # The mode of each control's distribution, as the edit pipelines encode a control (`argmax`).
                item["control_latents"] = torch.stack([self._cache.load_latents(slot, flipped=flip, sample=False)
                                                       for slot in self._control_slots[image_index]])
        else:
            crop_draw = rng.getstate()  # the controls crop with the target's draw
            if cfg.random_crop:
                bucket = self.bucket_sizes[self._image_bucket[image_index]]
                plan = plan_crop(image.width, image.height, bucket, rng)
            else:
                plan = self._fixed_plan(image_index)
            plan = replace(plan, flip=cfg.random_flip and rng.random() < 0.5)
            item["pixels"] = self._pixels(image_index, plan)
            if self.control_count:
                item["control_pixels"] = torch.stack([self._control_pixels(image_index, c, crop_draw, plan.flip)
                                                      for c in image.controls])
            mask = load_mask(image.mask_path, plan) if image.mask_path is not None else None
        if self.uses_masks:
            if mask is None:  # an image without a mask file is trained whole
                height, width = plan.target_size
                mask = torch.ones(1, height // VAE_FACTOR, width // VAE_FACTOR)
            item["mask"] = loss_weights(mask, image.unmasked_weight)
        item["loss_weight"] = image.loss_weight
        # The same draw with the text cached or not, so an item trains on the same caption either way.
        item["caption"] = process_caption(image.caption, rng, cfg.caption_dropout, cfg.shuffle_tags, cfg.keep_tags,
                                          cfg.caption_prefix, cfg.caption_suffix, cfg.tag_separator)
        if self._text_cached:
            dropped = item["caption"] != self.full_caption(image)
            item["text"] = (self._cache.load_extra_text(DROPPED_CAPTION) if dropped
                            else self._cache.load_text(image_index))
        if self.text_sees_controls:  # a text encoder that runs in the step reads the controls too
            item["caption"] = self.text_of(image, item["caption"])
        item["original_size"] = plan.original_size
        item["crop_coords"] = plan.crop_coords
        item["target_size"] = plan.target_size
        return item


def collate(items: Sequence[dict]) -> dict:
    """Stack items of one bucket into a batch dict (sizes as LongTensor [B, 2], (height, width))."""
    batch: dict = {"indices": torch.tensor([it["index"] for it in items], dtype=torch.long),
                   "captions": [it["caption"] for it in items],
                   "loss_weights": torch.tensor([float(it.get("loss_weight", 1.0)) for it in items])}
    if "mask" in items[0]:
        batch["masks"] = torch.stack([it["mask"] for it in items])
    for name in ("latents", "pixels", "control_latents", "control_pixels"):
        if name in items[0]:
            batch[name] = torch.stack([it[name] for it in items])
    if "text" in items[0]:
        batch["text"] = {k: pad_and_stack([it["text"][k] for it in items]) for k in items[0]["text"]}
    for single, plural in (("original_size", "original_sizes"), ("crop_coords", "crop_coords"),
                           ("target_size", "target_sizes")):
        batch[plural] = torch.tensor([list(it[single]) for it in items], dtype=torch.long)
    return batch


def pad_and_stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`torch.stack`, but tensors of different lengths (dim 0) are zero-padded to the longest first: the
    families whose captions keep their own number of tokens (Qwen-Image, Z-Image) cache each with a token
    mask of ones, which the zeros then mark as padding."""
    longest = max(t.shape[0] for t in tensors)
    if all(t.shape[0] == longest for t in tensors):
        return torch.stack(list(tensors))
    out = tensors[0].new_zeros((len(tensors), longest, *tensors[0].shape[1:]))
    for i, t in enumerate(tensors):
        out[i, :t.shape[0]] = t
    return out


def build_dataset(data_cfg: DataConfig, cache_dir: Path, seed: int, scan: ScanResult | None = None) -> TrainDataset:
    """Scan the concepts (unless `scan` is the result of a scan made already: a launcher's, carried to its
    workers) and assign buckets; needs no model, so data errors show up first. What the scan left out or will
    resize is said where the scan is made, once."""
    bucket_sizes = make_buckets(data_cfg.resolution, data_cfg.bucket_step, data_cfg.aspect_bucketing,
                                min_side=data_cfg.min_bucket_size, max_side=data_cfg.max_bucket_size)
    if scan is None:
        scan = scan_concepts(data_cfg.concepts, data_cfg.validation_fraction, clip_window(data_cfg))
        report_sizes([*scan.images, *scan.validation], bucket_sizes)
    return TrainDataset(scan, bucket_sizes, data_cfg, cache_dir, seed)


class _EpochTaggedBatches:
    """Sends the sampler's epoch along with each index: persistent workers hold their own copy of
    the dataset, so setting the epoch on the main process's copy would not reach them."""

    def __init__(self, batch_sampler):
        self.batch_sampler = batch_sampler

    def __iter__(self):
        epoch = getattr(self.batch_sampler, "epoch", 0)
        for indices in self.batch_sampler:
            yield [(epoch, i) for i in indices]

    def __len__(self) -> int:
        return len(self.batch_sampler)


class DataLoadingError(RuntimeError):
    """Loading a batch failed in this rank: one of its loader's worker processes died, or reading an item failed."""


def start_iteration(loader: DataLoader):
    """`iter(loader)`, a failure named as `loading_failure` names it. A later epoch's `iter` waits for every
    persistent worker to take its new order, so a worker that died between epochs ends it - as PyTorch's
    "DataLoader worker (pid(s) N) exited unexpectedly" - before any batch is taken."""
    try:
        return iter(loader)
    except (StopIteration, KeyboardInterrupt):
        raise
    except Exception as error:
        raise loading_failure(loader, error) from error


def loading_failure(loader: DataLoader, error: BaseException) -> DataLoadingError:
    """What went wrong with `loader` when taking a batch raised `error`, in words that name the dead worker.

    A worker killed by the system for lack of memory shows in the training process as whatever the loader
    happened to be doing - a pipe reset, a queue that ended - so the workers' exit codes are read first."""
    iterator = getattr(loader, "_iterator", None)
    workers = list(getattr(iterator, "_workers", []))
    # A killed worker's pipe closes while the kernel is still ending it: the reset can be read a moment before
    # its exit code can. What a dead worker looks like from here (a reset, a closed pipe) waits up to 2 s for it.
    patience = 2.0 if isinstance(error, (ConnectionError, EOFError)) else 0.0
    deadline = time.monotonic() + patience
    while True:
        dead = _dead_workers(workers)
        if dead or time.monotonic() >= deadline:
            break
        try:
            time.sleep(0.05)
        except RuntimeError:
            # PyTorch's SIGCHLD handler raising "DataLoader worker ... is killed by signal" while this waits:
            # the death being waited for; its exit code is read on the next pass.
            continue
    if dead:
        pid, code = dead[0]
        how = _signal_name(-code) if code < 0 else f"exit code {code}"
        return DataLoadingError(f"a data loading worker (pid {pid}) of this rank died ({how})")
    return DataLoadingError(f"loading a batch failed: {type(error).__name__}: {error}")


def _dead_workers(workers: list) -> list[tuple[int, int]]:
    """(pid, exit code) of each loader worker that has ended with a failure."""
    dead = []
    for worker in workers:
        try:
            code = worker.exitcode
        except Exception:  # noqa: BLE001 - a process already reaped: not known
            continue
        if code not in (None, 0):
            dead.append((worker.pid, code))
    return dead


def _signal_name(number: int) -> str:
    import signal
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def loader_worker_context():
    """How the loader's worker processes start: forked on Linux, whatever launched this process.

    A rank of the spawn launcher inherits its start method as the default ("forkserver" on Linux, "spawn"
    elsewhere), and workers started that way import torch and the model libraries again before their
    first batch (spawned ranks waited ~10 s more before step 1 than torchrun's on H100 hosts, 3.4 s on 2
    CPU processes). Forked workers are what a torchrun rank gets.
    Elsewhere (Windows, macOS) spawning is the only safe way, as it is for the ranks."""
    return multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None


def make_dataloader(dataset: TrainDataset, batch_sampler, data_cfg: DataConfig, device_is_cuda: bool) -> DataLoader:
    workers = max(0, data_cfg.num_workers)
    return DataLoader(dataset, batch_sampler=_EpochTaggedBatches(batch_sampler), collate_fn=collate,
                      num_workers=workers, pin_memory=data_cfg.pin_memory and device_is_cuda,
                      prefetch_factor=data_cfg.prefetch_factor if workers > 0 else None,
                      persistent_workers=workers > 0,
                      worker_init_fn=functools.partial(end_with_the_rank, os.getpid()) if workers > 0 else None,
                      multiprocessing_context=loader_worker_context() if workers > 0 else None)


def end_with_the_rank(rank_pid: int, worker_id: int) -> None:
    """A loader worker dies with the training process that started it (`rank_pid`: killed, or its launcher
    killed): it would otherwise notice only at its next look, seconds later, holding its memory meanwhile.

    And it leaves stop signals to its rank. A SIGTERM or SIGINT to the whole process group - a scheduler's or
    the GUI's "terminate", a Ctrl-C in the terminal, torchrun's agent ending its workers' groups - reaches the
    loader workers too; dying of it, they failed their rank ("DataLoader worker ... killed by signal:
    Terminated") before the rank could take its clean stop with a backup. Ignored here, the worker ends with
    its rank: when the loader shuts down, or by the parent-death signal. (A worker the loader's shut-down
    cannot join and terminates then stays until its rank exits - moments later.)"""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent(rank_pid)
