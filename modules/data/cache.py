"""On-disk cache of VAE latents and text embeddings, one safetensors file per entry.

Keys are content hashes of everything that decides an entry's value, never of who computed it:
- latents: image bytes (sha256), model fingerprint, resize/crop plan (original size, resized size,
  crop offset, bucket size) and whether a mirrored copy is stored;
- text: caption and model fingerprint;
- masks (`masks.py`): mask bytes (sha256) and the image's resize/crop plan (no model: a mask is the same
  for every model; their own format number, so latent and text entries kept their keys when masks came).
So an edited image, another model, another resolution/bucket or another caption misses the cache
for exactly the affected entries; everything else is reused, also by a run with another number of
ranks. Stale files are left in place (they are never read again); delete the folder to reclaim space.

Nor does an entry's value depend on who computed it. A VAE's latents are a sample of a distribution:
a sample drawn while caching would depend on the order the images were encoded in, and so on the
number of ranks. The cache stores the distribution (its mean and std) instead, and each use of an
item draws its sample from a generator the dataset keys by (seed, epoch, item) alone. And entries are
encoded in batches cut from the data (same-size images in item order, `batch_size` at a time), whole
batches going to ranks, so an image has the same batch-mates - which decide a kernel's rounding -
whatever the number of ranks: a cache built from scratch by 1 or by N processes is bitwise the same
(on one device type and thread count: CPU kernels may round differently with other thread counts).
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from modules.util.atomic import save_safetensors_atomically
from modules.util.durations import format_seconds

from .buckets import CropPlan, load_pixels
from .masks import flip_mask, load_mask
from .video import load_clip

log = logging.getLogger("tandem")

CACHE_FORMAT = 2
"""Part of every key: bump it when the stored layout changes, so old entries are not misread.
2: latent distributions (mean, std) instead of one sample drawn while caching."""

MASK_FORMAT = 1
"""Part of every mask entry's key, bumped like CACHE_FORMAT. 1: float32 [1, H/8, W/8], un-flipped, before
`unmasked_weight` (which may change without re-caching)."""

EncodeImages = Callable[[torch.Tensor], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]
"""CPU float32 pixels in [-1, 1], [B, 3, H, W] -> latents [B, C, H/8, W/8], or the (mean, std) of
their distribution (`ModelBundle.encode_latent_distribution`), of which each use draws a sample.
Moving to the device and dtype is the encoder's job. Entries are stored in the dtype it returns."""
EncodeText = Callable[[list[str]], dict[str, torch.Tensor]]
"""B captions -> named tensors with the batch dimension first (e.g. `encoder_hidden_states`)."""


@dataclass(frozen=True)
class CacheItem:
    """What the cache needs to know about one dataset item."""

    image_path: Path
    content_hash: str
    plan: CropPlan
    """The un-flipped resize/crop plan."""
    with_flipped: bool = False
    """Also store the mirrored latents (for random flips on cached latents)."""
    caption: str | None = None
    """Caption whose embedding is cached; None when text is not cached."""
    mask_path: Path | None = None
    """The image's loss mask, cached at latent resolution; None without one."""
    mask_hash: str = ""
    frames: tuple[int, ...] = ()
    """A video clip's window: the source frames it trains on (`video.py`); () for an image."""


def _digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:40]


def latent_key(item: CacheItem, fingerprint: str) -> str:
    parts = {"format": CACHE_FORMAT, "kind": "latents", "image": item.content_hash, "model": fingerprint,
             "plan": replace(item.plan, flip=False).key(), "flipped": item.with_flipped}
    if item.frames:  # a clip's window (images keep the keys they had before clips came)
        parts["frames"] = list(item.frames)
    return _digest(parts)


def mask_key(item: CacheItem) -> str:
    return _digest({"format": MASK_FORMAT, "kind": "mask", "mask": item.mask_hash,
                    "plan": replace(item.plan, flip=False).key()})


def text_key(caption: str, fingerprint: str) -> str:
    return _digest({"format": CACHE_FORMAT, "kind": "text", "caption": caption, "model": fingerprint})


def _write_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    # A unique temporary name plus rename: a crash never leaves a half-written entry under the
    # final name, and two ranks writing the same entry cannot corrupt each other.
    save_safetensors_atomically({k: v.clone() for k, v in tensors.items()}, path)


@dataclass
class CacheIndex:
    """Where each item's entries live; every rank can read every entry after the barrier."""

    latent_files: list[Path | None]
    text_files: list[Path | None]
    encoded_images: int = 0
    """Images this rank encoded in `fill_cache` (mirrored copies count separately)."""
    encoded_texts: int = 0
    """Captions this rank encoded in `fill_cache`."""
    mask_files: list[Path | None] = field(default_factory=list)
    """Per item, its mask entry (None: no mask); empty when no item has one."""
    extra_text_files: dict[str, Path] = field(default_factory=dict)
    """Caption -> entry of the captions cached beside the items' own (`fill_cache`'s `extra_captions`)."""

    def load_latents(self, index: int, flipped: bool = False, generator: torch.Generator | None = None,
                     sample: bool = True) -> torch.Tensor:
        """Image `index`'s latents: stored ones, or (float32) a sample of the stored distribution drawn
        from `generator` - the caller keys it, so the sample does not depend on who loads the item; with
        `sample=False` the distribution's mean (its mode)."""
        path = self.latent_files[index]
        if path is None:
            raise KeyError(f"Item {index} has no cached latents.")
        entry = _load(path)
        suffix = "_flipped" if flipped else ""
        if f"mean{suffix}" in entry:
            mean, std = entry[f"mean{suffix}"].float(), entry[f"std{suffix}"].float()
            if not sample:
                return mean
            return mean + std * torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
        if f"latents{suffix}" not in entry:
            raise KeyError(f"Cache entry {path} has no {'flipped ' if flipped else ''}latents; it was written "
                           "without flips.")
        return entry[f"latents{suffix}"]

    def load_mask(self, index: int, flipped: bool = False) -> torch.Tensor | None:
        """Image `index`'s mask at latent resolution (`masks.load_mask`), None when it has none."""
        path = self.mask_files[index] if index < len(self.mask_files) else None
        if path is None:
            return None
        mask = _load(path)["mask"]
        return flip_mask(mask) if flipped else mask

    def load_text(self, index: int) -> dict[str, torch.Tensor]:
        path = self.text_files[index]
        if path is None:
            raise KeyError(f"Item {index} has no cached text embedding.")
        return _load(path)

    def load_extra_text(self, caption: str) -> dict[str, torch.Tensor]:
        """The cached embedding of one of `fill_cache`'s `extra_captions` (the empty caption of caption dropout)."""
        if caption not in self.extra_text_files:
            raise KeyError(f"Caption {caption!r} has no cached text embedding (not one of the extra captions).")
        return _load(self.extra_text_files[caption])

    def missing(self) -> list[Path]:
        """Entry files that do not exist (after all ranks filled their share, this is empty)."""
        files = {p for p in self.latent_files + self.text_files + self.mask_files + list(self.extra_text_files.values())
                 if p is not None}
        return sorted(p for p in files if not p.is_file())


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError as err:
        raise FileNotFoundError(f"Cache entry {path} is missing: did every rank finish caching before "
                                "the barrier? Deleting the cache folder forces a rebuild.") from err


def _batches(keys: list[str], size_of: Callable[[str], object], batch_size: int) -> list[list[str]]:
    """`keys` cut into encoding batches by the data alone: keys of one size together, in order."""
    groups: dict[object, list[str]] = {}
    for key in keys:
        groups.setdefault(size_of(key), []).append(key)
    return [group[i:i + batch_size] for group in groups.values() for i in range(0, len(group), batch_size)]


def _my_batches(batches: list[list[str]], rank: int, world_size: int) -> list[list[str]]:
    """This rank's whole batches: the largest first, each to the rank with the least work so far (ties:
    the lowest rank). Every rank computes the same assignment."""
    load = [0] * world_size
    mine = []
    for batch in sorted(batches, key=len, reverse=True):  # stable: equal sizes keep their order
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += len(batch)
        if owner == rank:
            mine.append(batch)
    return mine


def fill_cache(items: Sequence[CacheItem], encode_images: EncodeImages | None, encode_text: EncodeText | None,
               fingerprint: str, cache_dir: Path, rank: int = 0, world_size: int = 1, batch_size: int = 8,
               progress: bool = True, extra_captions: Sequence[str] = ()) -> CacheIndex:
    """Encode this rank's share of the missing entries and return the index of all entries.

    Distinct entries, in item order, are cut into batches (images of one size together), and whole
    batches are shared out over the ranks (`_my_batches`), so the share and every batch depend on
    the data only. A batch is encoded when entries of it are missing; only those are encoded.
    `encode_images=None` caches no latents; `encode_text=None` (or items with `caption=None`)
    caches no text. `extra_captions` are cached too when text is (after the items' captions): the empty
    caption that caption dropout trains on. Call a barrier afterwards before reading entries that other
    ranks wrote.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}.")
    cache_dir = Path(cache_dir)
    latent_dir, text_dir, mask_dir = cache_dir / "latents", cache_dir / "text", cache_dir / "masks"
    latent_files: list[Path | None] = []
    text_files: list[Path | None] = []
    mask_files: list[Path | None] = []
    latent_items: dict[str, CacheItem] = {}
    mask_items: dict[str, CacheItem] = {}
    captions: dict[str, str] = {}
    for item in items:
        if encode_images is not None and item.mask_path is not None:
            key = mask_key(item)
            mask_items.setdefault(key, item)
            mask_files.append(mask_dir / f"{key}.safetensors")
        else:
            mask_files.append(None)
        if encode_images is not None:
            key = latent_key(item, fingerprint)
            latent_items.setdefault(key, item)
            latent_files.append(latent_dir / f"{key}.safetensors")
        else:
            latent_files.append(None)
        if encode_text is not None and item.caption is not None:
            key = text_key(item.caption, fingerprint)
            captions.setdefault(key, item.caption)
            text_files.append(text_dir / f"{key}.safetensors")
        else:
            text_files.append(None)
    extra_text_files: dict[str, Path] = {}
    if encode_text is not None and any(item.caption is not None for item in items):
        for caption in extra_captions:
            key = text_key(caption, fingerprint)
            captions.setdefault(key, caption)
            extra_text_files[caption] = text_dir / f"{key}.safetensors"

    def missing(batches: list[list[str]], folder: Path) -> list[list[str]]:
        batches = ([k for k in batch if not (folder / f"{k}.safetensors").is_file()] for batch in batches)
        return [batch for batch in batches if batch]

    latent_batches = missing(_my_batches(_batches(list(latent_items), lambda k: (latent_items[k].plan.target_size,
                                                                                 len(latent_items[k].frames)),
                                                  batch_size), rank, world_size), latent_dir)
    text_batches = missing(_my_batches(_batches(list(captions), lambda k: None, batch_size), rank, world_size),
                           text_dir)
    mask_batches = missing(_my_batches(_batches(list(mask_items), lambda k: None, batch_size), rank, world_size),
                           mask_dir)
    index = CacheIndex(latent_files, text_files, mask_files=mask_files if mask_items else [],
                       extra_text_files=extra_text_files)
    todo = sum(map(len, latent_batches)) + sum(map(len, text_batches)) + sum(map(len, mask_batches))
    if not todo:
        return index
    latent_dir.mkdir(parents=True, exist_ok=True)
    text_dir.mkdir(parents=True, exist_ok=True)
    if mask_batches:
        mask_dir.mkdir(parents=True, exist_ok=True)

    with _caching_progress(todo, rank, progress) as bar:
        if latent_batches:
            index.encoded_images = _encode_latents(latent_batches, latent_items, encode_images, latent_dir, bar)
        for keys in text_batches:
            with torch.no_grad():
                encoded = encode_text([captions[k] for k in keys])
            for row, key in enumerate(keys):
                _write_atomic({name: value[row] for name, value in encoded.items()},
                              text_dir / f"{key}.safetensors")
            index.encoded_texts += len(keys)
            bar.update(len(keys))
        for keys in mask_batches:
            for key in keys:
                item = mask_items[key]
                _write_atomic({"mask": load_mask(item.mask_path, replace(item.plan, flip=False))},
                              mask_dir / f"{key}.safetensors")
            bar.update(len(keys))
    return index


def text_entry(caption: str, fingerprint: str, cache_dir: Path) -> Path:
    """Where the text cache keeps the embedding of `caption`."""
    return Path(cache_dir) / "text" / f"{text_key(caption, fingerprint)}.safetensors"


def fill_text_cache(captions: Sequence[str], encode_text: EncodeText, fingerprint: str, cache_dir: Path,
                    rank: int = 0, world_size: int = 1, batch_size: int = 8, progress: bool = True) -> int:
    """Encode this rank's share of the missing entries of `captions` (whole batches cut from the captions in
    their order, shared out as `fill_cache` shares them); returns how many this rank encoded. Call a barrier
    before reading entries other ranks wrote."""
    keys = {text_key(caption, fingerprint): caption for caption in captions}
    text_dir = Path(cache_dir) / "text"
    batches = [[k for k in batch if not (text_dir / f"{k}.safetensors").is_file()]
               for batch in _my_batches(_batches(list(keys), lambda k: None, batch_size), rank, world_size)]
    batches = [batch for batch in batches if batch]
    todo = sum(map(len, batches))
    if not todo:
        return 0
    text_dir.mkdir(parents=True, exist_ok=True)
    with _caching_progress(todo, rank, progress) as bar:
        for batch in batches:
            with torch.no_grad():
                encoded = encode_text([keys[k] for k in batch])
            for row, key in enumerate(batch):
                _write_atomic({name: value[row] for name, value in encoded.items()}, text_dir / f"{key}.safetensors")
            bar.update(len(batch))
    return todo


class Progress(Protocol):
    """Where caching counts its finished entries: a tqdm bar or `_LoggedProgress`."""

    def update(self, n: int = 1) -> object: ...


class _LoggedProgress:
    """Caching progress for a log file: a line every few seconds and one when this rank's share is done.

    Only the rank that reports logs (`reports`): each rank encodes an equal share, so rank 0's count stands
    for the others', whose lines would only repeat it.
    """

    LOG_EVERY_S = 5.0

    def __init__(self, total: int, reports: bool) -> None:
        self.total = total
        self.reports = reports
        self.done = 0
        self.started = self.last_log = time.perf_counter()

    def __enter__(self) -> _LoggedProgress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:  # a failed share says so with its error, not with a line that looks finished
            self._log(time.perf_counter())

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.done < self.total and now - self.last_log >= self.LOG_EVERY_S:
            self._log(now)

    def _log(self, now: float) -> None:
        self.last_log = now
        if not self.reports:
            return
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 and self.done else None
        speed = f"{rate:.1f} entries/s" if rate else "measuring speed"
        eta = format_seconds((self.total - self.done) / rate if rate else None)
        log.info("Caching: %d/%d entries (%d%%) on this rank, %s, ETA %s", self.done, self.total,
                 100 * self.done // max(1, self.total), speed, eta)


def _caching_progress(total: int, rank: int, show: bool) -> AbstractContextManager[Progress]:
    """A bar per rank in a terminal. Elsewhere (a log file, a pipe, nohup, a scheduler) a bar cannot redraw
    in place: every update would add a line, cursor moves included, from every rank; there rank 0 logs
    plain lines instead, as the training loop does for its steps."""
    if sys.stderr.isatty():
        return tqdm(total=total, desc=f"Caching (rank {rank})", unit="entry", position=rank, disable=not show,
                    leave=rank == 0)
    return _LoggedProgress(total, reports=show and rank == 0)


def _encode_latents(chunks: list[list[str]], items: dict[str, CacheItem], encode_images: EncodeImages,
                    latent_dir: Path, bar: Progress) -> int:
    """Encode the images of each chunk (one batch of same-size images), keeping the encoder busy.

    Decoding and resizing (loader threads; PIL releases the GIL) and writing entries (one writer
    thread) overlap with encoding, so the encoder waits on neither; a rank's caching then scales with
    its share of the images instead of being held up by one thread's file work. At most a few
    batches are decoded ahead, so memory stays bounded whatever the dataset's size.
    """
    def load(chunk: list[str]) -> tuple[torch.Tensor, list[tuple[str, str]]]:
        pixels, owners = [], []
        for key in chunk:
            item = items[key]
            plan = replace(item.plan, flip=False)
            image = (load_clip(item.image_path, plan, item.frames) if item.frames
                     else load_pixels(item.image_path, plan))
            pixels.append(image)
            owners.append((key, "latents"))
            if item.with_flipped:
                pixels.append(torch.flip(image, dims=[-1]))
                owners.append((key, "latents_flipped"))
        return torch.stack(pixels), owners

    def write(entries: dict[str, dict[str, torch.Tensor]]) -> None:
        for key, tensors in entries.items():
            _write_atomic(tensors, latent_dir / f"{key}.safetensors")

    threads = max(1, min(8, torch.get_num_threads()))
    encoded_images = 0
    with ThreadPoolExecutor(threads, thread_name_prefix="cache-load") as loaders, \
            ThreadPoolExecutor(1, thread_name_prefix="cache-write") as writer:
        ahead = deque(loaders.submit(load, chunk) for chunk in chunks[:threads + 1])
        next_chunk = len(ahead)
        writes: deque[Future] = deque()
        while ahead:
            pixels, owners = ahead.popleft().result()  # re-raises a loader's error here
            if next_chunk < len(chunks):
                ahead.append(loaders.submit(load, chunks[next_chunk]))
                next_chunk += 1
            with torch.no_grad():
                encoded = encode_images(pixels)
            # Latents, or a distribution stored as its mean and std ("latents" -> "mean", "std").
            parts = {"": encoded} if torch.is_tensor(encoded) else dict(zip(("mean", "std"), encoded))
            entries: dict[str, dict[str, torch.Tensor]] = {}
            for prefix, tensor in parts.items():
                if tensor.shape[0] != len(owners):
                    raise ValueError(f"encode_images returned {tensor.shape[0]} latents for {len(owners)} images; "
                                     "it must keep the batch dimension first.")
                tensor = tensor.cpu()
                for row, (key, name) in enumerate(owners):
                    entries.setdefault(key, {})[name.replace("latents", prefix) if prefix else name] = tensor[row]
            writes.append(writer.submit(write, entries))
            while writes and writes[0].done():
                writes.popleft().result()  # a failed write stops caching now, not at the end
            encoded_images += len(owners)
            bar.update(len({key for key, _ in owners}))
        for pending in writes:
            pending.result()
    return encoded_images
