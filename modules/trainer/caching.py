"""Encoding the latent and text caches before training, shared out over the ranks.

Each rank encodes its share of the entries (`multi_gpu.distributed_data_loading`; off: rank 0 encodes
everything while the others wait), then all read the whole cache (`modules/data/cache.py` says why the
entries do not depend on who encoded them). With several machines a cache folder on each machine's own
disk lacks what the other machines' ranks encoded, so each machine's ranks then encode what is missing
there (nothing, with a shared folder). Once cached, the VAE (and frozen text encoders) only serve samples:
on a GPU they leave it (`offload_cached_encoders`).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import torch

from modules.util import dist_utils as du

log = logging.getLogger("tandem")


def fill_caches(datasets: list, bundle, cache_text: bool, share_work: bool, model_seconds: float,
                emit: Callable[..., None]) -> dict[str, float]:
    """Encode the latents (and text, `cache_text`) of `datasets` once, every rank together (a collective).
    `model_seconds`: how long this rank took to load the model. Returns the caching phase's parts (with
    several processes: waiting for the slowest rank's model, encoding)."""
    waiting = time.perf_counter()
    # Ranks finish loading the model at different times: the caching is timed once all have (this
    # collective is also the barrier), and which rank was slowest is said.
    every_model_seconds = du.all_gather_objects(model_seconds)
    started = time.perf_counter()
    if du.world_size() > 1:
        slowest = max(range(len(every_model_seconds)), key=every_model_seconds.__getitem__)
        log.info("Model loaded in %.1f-%.1f s on the %d ranks (slowest: rank %d).", min(every_model_seconds),
                 every_model_seconds[slowest], len(every_model_seconds), slowest)
    encoders = (bundle.encode_latent_distribution, bundle.encode_text, bundle.fingerprint())
    with torch.no_grad(), (contextlib.nullcontext() if share_work else du.main_first()):
        for dataset in datasets:
            dataset.cache(*encoders, rank=du.rank() if share_work else 0,
                          world_size=du.world_size() if share_work else 1, cache_text=cache_text)
    du.barrier()
    if du.local_world_size() < du.world_size():
        # Several machines: a cache folder on each machine's own disk lacks what the other machines' ranks
        # encoded. This machine's ranks encode what is missing here (nothing, with a shared folder).
        with torch.no_grad():
            for dataset in datasets:
                dataset.cache(*encoders, rank=du.local_rank(), world_size=du.local_world_size(),
                              cache_text=cache_text, progress=False)
        du.barrier()
    seconds = time.perf_counter() - started
    shared = "each encoded its share" if share_work else "rank 0 encoded, the others reused it"
    log.info("Cache ready in %.1f s%s", seconds, f" ({du.world_size()} processes, {shared})" if du.world_size() > 1 else "")
    emit("cache", seconds=round(seconds, 2), world_size=du.world_size(), shared=share_work)
    if du.world_size() == 1:
        return {}
    # Where a multi-GPU start's `cache` phase goes: mostly waiting for the slowest rank's model, on H100s.
    return {"waiting for the slowest rank's model": started - waiting, "encoding": seconds}


def offload_cached_encoders(bundle, device: torch.device, latents_cached: bool, text_cached: bool) -> float | None:
    """With latents (text) cached, the VAE (frozen text encoders) only serve samples: keep them off the GPU,
    on the host tensors they were loaded from where the loader kept them (`model/host_copies.py`). Returns
    how long that took on a GPU (a start-up part of the cache phase), None elsewhere."""
    if device.type != "cuda":
        return None
    from modules.model.host_copies import move_to_host
    started = time.perf_counter()
    if latents_cached:
        move_to_host(bundle, bundle.vae)
    if text_cached:
        for te in bundle.text_encoders:
            move_to_host(bundle, te)
    return time.perf_counter() - started
