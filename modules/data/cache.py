"""On-disk cache of VAE latents and text embeddings, one safetensors file per entry.

Keys are content hashes of everything that decides an entry's value, never of who computed it:
- latents: image bytes (sha256), model fingerprint, resize/crop plan (original size, resized size,
  crop offset, bucket size) and whether a mirrored copy is stored;
- text: caption and model fingerprint.
So an edited image, another model, another resolution/bucket or another caption misses the cache
for exactly the affected entries; everything else is reused, also by a run with another number of
ranks. Stale files are left in place (they are never read again); delete the folder to reclaim space.
"""
from __future__ import annotations

import hashlib
import json
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from modules.util.atomic import save_safetensors_atomically

from .buckets import CropPlan, load_pixels

CACHE_FORMAT = 1
"""Part of every key: bump it when the stored layout changes, so old entries are not misread."""

EncodeImages = Callable[[torch.Tensor], torch.Tensor]
"""CPU float32 pixels in [-1, 1], [B, 3, H, W] -> latents [B, C, H/8, W/8]; moving to the device
and dtype is the encoder's job. Entries are stored in the dtype it returns."""
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


def _digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:40]


def latent_key(item: CacheItem, fingerprint: str) -> str:
    return _digest({"format": CACHE_FORMAT, "kind": "latents", "image": item.content_hash,
                    "model": fingerprint, "plan": replace(item.plan, flip=False).key(),
                    "flipped": item.with_flipped})


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

    def load_latents(self, index: int, flipped: bool = False) -> torch.Tensor:
        path = self.latent_files[index]
        if path is None:
            raise KeyError(f"Item {index} has no cached latents.")
        entry = _load(path)
        key = "latents_flipped" if flipped else "latents"
        if key not in entry:
            raise KeyError(f"Cache entry {path} has no {key!r}; it was written without flips.")
        return entry[key]

    def load_text(self, index: int) -> dict[str, torch.Tensor]:
        path = self.text_files[index]
        if path is None:
            raise KeyError(f"Item {index} has no cached text embedding.")
        return _load(path)

    def missing(self) -> list[Path]:
        """Entry files that do not exist (after all ranks filled their share, this is empty)."""
        files = {p for p in self.latent_files + self.text_files if p is not None}
        return sorted(p for p in files if not p.is_file())


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError as err:
        raise FileNotFoundError(f"Cache entry {path} is missing: did every rank finish caching before "
                                "the barrier? Deleting the cache folder forces a rebuild.") from err


def _my_share(keys: list[str], rank: int, world_size: int) -> list[str]:
    return [k for i, k in enumerate(keys) if i % world_size == rank]


def fill_cache(items: Sequence[CacheItem], encode_images: EncodeImages | None, encode_text: EncodeText | None,
               fingerprint: str, cache_dir: Path, rank: int = 0, world_size: int = 1, batch_size: int = 8,
               progress: bool = True) -> CacheIndex:
    """Encode this rank's share of the missing entries and return the index of all entries.

    The share is every `world_size`-th distinct entry starting at `rank`, over entries in item
    order, so it depends on the data only. `encode_images=None` caches no latents; `encode_text=None`
    (or items with `caption=None`) caches no text. Call a barrier afterwards before reading entries
    that other ranks wrote.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}.")
    cache_dir = Path(cache_dir)
    latent_dir, text_dir = cache_dir / "latents", cache_dir / "text"
    latent_files: list[Path | None] = []
    text_files: list[Path | None] = []
    latent_items: dict[str, CacheItem] = {}
    captions: dict[str, str] = {}
    for item in items:
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

    latent_todo = [k for k in _my_share(list(latent_items), rank, world_size)
                   if not (latent_dir / f"{k}.safetensors").is_file()]
    text_todo = [k for k in _my_share(list(captions), rank, world_size)
                 if not (text_dir / f"{k}.safetensors").is_file()]
    index = CacheIndex(latent_files, text_files)
    if not latent_todo and not text_todo:
        return index
    latent_dir.mkdir(parents=True, exist_ok=True)
    text_dir.mkdir(parents=True, exist_ok=True)

    with tqdm(total=len(latent_todo) + len(text_todo), desc=f"Caching (rank {rank})", unit="entry",
              position=rank, disable=not progress, leave=rank == 0) as bar:
        if latent_todo:
            index.encoded_images = _encode_latents(latent_todo, latent_items, encode_images, latent_dir,
                                                   batch_size, bar)
        for start in range(0, len(text_todo), batch_size):
            keys = text_todo[start:start + batch_size]
            with torch.no_grad():
                encoded = encode_text([captions[k] for k in keys])
            for row, key in enumerate(keys):
                _write_atomic({name: value[row] for name, value in encoded.items()},
                              text_dir / f"{key}.safetensors")
            index.encoded_texts += len(keys)
            bar.update(len(keys))
    return index


def _encode_latents(keys: list[str], items: dict[str, CacheItem], encode_images: EncodeImages,
                    latent_dir: Path, batch_size: int, bar: tqdm) -> int:
    """Encode the images of `keys` in batches, keeping the encoder busy.

    Decoding and resizing (loader threads; PIL releases the GIL) and writing entries (one writer
    thread) overlap with encoding, so the encoder waits on neither; a rank's caching then scales with
    its share of the images instead of being held up by one thread's file work. At most a few
    batches are decoded ahead, so memory stays bounded whatever the dataset's size.
    """
    # Images only stack with images of the same size, so batch within each bucket size.
    by_size: dict[tuple[int, int], list[str]] = {}
    for key in keys:
        by_size.setdefault(items[key].plan.target_size, []).append(key)
    chunks = [size_keys[start:start + batch_size]
              for size_keys in by_size.values() for start in range(0, len(size_keys), batch_size)]

    def load(chunk: list[str]) -> tuple[torch.Tensor, list[tuple[str, str]]]:
        pixels, owners = [], []
        for key in chunk:
            item = items[key]
            image = load_pixels(item.image_path, replace(item.plan, flip=False))
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
                latents = encode_images(pixels)
            if latents.shape[0] != len(owners):
                raise ValueError(f"encode_images returned {latents.shape[0]} latents for {len(owners)} images; "
                                 "it must keep the batch dimension first.")
            latents = latents.cpu()
            entries: dict[str, dict[str, torch.Tensor]] = {}
            for row, (key, name) in enumerate(owners):
                entries.setdefault(key, {})[name] = latents[row]
            writes.append(writer.submit(write, entries))
            while writes and writes[0].done():
                writes.popleft().result()  # a failed write stops caching now, not at the end
            encoded_images += len(owners)
            bar.update(len({key for key, _ in owners}))
        for pending in writes:
            pending.result()
    return encoded_images
