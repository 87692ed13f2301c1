"""The text cache of a family whose text encoder is loaded apart, filled before its transformer loads.

Qwen-Image's text encoder (Qwen2.5-VL, 16.6 GB in bf16) and Z-Image's (Qwen3 4B, 8 GB) never train and
only turn captions into embeddings (`modules/model/text_apart.py`). So for those families the trainer calls
`encode_text_apart` after scanning the data and before loading the model: every text the run needs - the
captions of the training and validation images, the dropped caption, the sample prompts and their negative
prompts - is encoded into the text cache, each rank encoding its share as the latent cache does, and the
encoder is freed. No GPU ever holds it beside the transformer, and a run whose cache already holds every
text never loads it at all.

Where the encoder runs (`model.text_encoder_placement`, decided once for all ranks):

- `gpu`: a whole copy on each GPU (in its storage dtype: bf16, or fp8 - Linear weights in float8);
- `sharded`: its decoder layers split over the GPUs of the run with FSDP2, each GPU encoding its own share
  of the texts; every forward gathers each layer from all ranks, so the ranks run their forwards in lock
  step (`PlacedEncoder`: a rank out of texts runs throw-away forwards until every rank is done);
- `offload`: the weights stay in host memory and each decoder layer is copied to the GPU for its forward;
- `cpu`: encoding on the CPU (CPU runs);
- `auto`: `gpu` where the weights plus activations fit the free memory of every GPU, else `sharded` when
  a 1/N share fits, else `offload`.

The start-up log says which, the encoder's size, and how long loading and encoding took.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modules.util import dist_utils as du

log = logging.getLogger("tandem")

GIB = 2 ** 30
HEADROOM_GIB = 4.0
"""GPU memory besides the weights for encoding a batch of 8 texts of up to 512 tokens: the hidden states of
every layer are returned (Qwen2.5-VL 7B: 29 x 8 x 546 x 3584 x 2 bytes = 0.9 GB) plus attention and MLP
activations, with room for the allocator."""
PLACEMENTS = ("gpu", "sharded", "offload", "cpu")


@dataclass
class TextEncodingReport:
    """What `encode_text_apart` did, for the start-up log and the tests."""

    placement: str = "not loaded"
    texts: int = 0
    """Distinct texts the run's text cache holds."""
    encoded: int = 0
    """Texts this rank encoded."""
    gib: float = 0.0
    """The encoder's weights, whole, in their storage dtype."""
    load_seconds: float = 0.0
    encode_seconds: float = 0.0
    samples: dict[str, Path] = field(default_factory=dict)
    """Sample prompt -> its cache entry (samples read them instead of encoding)."""


def encode_text_apart(cfg, datasets, device: torch.device, cache_dir: Path) -> TextEncodingReport | None:
    """Fill the text cache with every text the run needs, if the model's family loads its text encoder apart;
    None for the other families (their text is cached with the latents, `BaseTrainer.fill_cache`)."""
    from modules.data.cache import fill_text_cache, text_entry
    from modules.data.dataset import text_cache_allowed
    from modules.model.loading import build_builtin_first, load_text_side

    build_builtin_first(cfg.model)  # then every rank loads at once
    light = load_text_side(cfg.model, cfg.training)
    if light is None:
        return None
    title = light.family.info.title
    if not text_cache_allowed(cfg.data, cfg.training.train_text_encoder):
        raise ValueError(f"{title} trains from cached text only (its text encoder is loaded apart and never "
                         "trains): set data.cache_text_embeddings to true, data.shuffle_tags to false and "
                         "training.train_text_encoder to false")
    side, fingerprint = light.extra["text_side"], light.fingerprint()
    samples = light.family.sample_texts(cfg.sampling)
    texts = list(dict.fromkeys([t for dataset in datasets for t in dataset.texts_to_cache()] + samples))
    report = TextEncodingReport(texts=len(texts), samples={t: text_entry(t, fingerprint, cache_dir) for t in samples})
    missing = sum(not text_entry(t, fingerprint, cache_dir).is_file() for t in texts)
    if not max(du.all_gather_objects(missing)):
        log.info("Text encoder: not loaded - the text cache holds all %d texts of this run.", len(texts))
        return report

    report.placement = choose_placement(cfg.model.text_encoder_placement, side, device)
    report.gib = side.parameter_bytes() / GIB
    placed = PlacedEncoder(side, report.placement, device)
    if report.placement == "sharded":
        placed.place()  # collective: every rank holds its share, whether it has texts to encode or not
    share = cfg.multi_gpu.distributed_data_loading
    started = time.perf_counter()
    try:
        with torch.no_grad():
            if share or du.rank() == 0:
                report.encoded = fill_text_cache(texts, placed, fingerprint, cache_dir,
                                                 du.rank() if share else 0, du.world_size() if share else 1)
            placed.drain()
        du.barrier()
        if du.local_world_size() < du.world_size():
            # Several machines: a cache folder on each machine's own disk lacks the other machines' entries.
            with torch.no_grad():
                report.encoded += fill_text_cache(texts, placed, fingerprint, cache_dir, du.local_rank(),
                                                  du.local_world_size(), progress=False)
                placed.drain()
            du.barrier()
    finally:
        side.release()
    report.load_seconds = placed.load_seconds
    report.encode_seconds = time.perf_counter() - started - placed.load_seconds
    log.info("Text encoder (%s, %s, %.1f GiB): %s; loaded in %.1f s, %d of %d texts encoded in %.1f s (this rank: "
             "%d), then freed before the transformer loads.", side.class_name, side.storage, report.gib,
             describe_placement(report.placement, report.gib), report.load_seconds, missing, len(texts),
             report.encode_seconds, report.encoded)
    return report


def choose_placement(requested: str, side, device: torch.device) -> str:
    """Where the encoder runs (see the module docstring); the same answer on every rank."""
    world = du.world_size()
    if requested not in ("auto", *PLACEMENTS):
        raise ValueError(f"model.text_encoder_placement is {requested!r}; use auto, {', '.join(PLACEMENTS)}")
    if device.type != "cuda":
        return "sharded" if requested == "sharded" and world > 1 else "cpu"
    if requested == "sharded" and world == 1:
        return "gpu"
    if requested != "auto":
        return requested
    free = min(du.all_gather_objects(torch.cuda.mem_get_info(device)[0])) / GIB
    weights = side.parameter_bytes() / GIB
    if weights * 1.05 + HEADROOM_GIB <= free:
        choice = "gpu"
    elif world > 1 and weights / world * 1.05 + HEADROOM_GIB <= free:
        choice = "sharded"
    else:
        choice = "offload"
    return du.broadcast_object(choice)


def describe_placement(placement: str, gib: float) -> str:
    world = du.world_size()
    return {"gpu": "a whole copy on each GPU",
            "sharded": f"sharded over the {world} processes ({gib / max(1, world):.1f} GiB each)",
            "offload": "offloaded: weights in host memory, each layer copied to the GPU as it runs",
            "cpu": "on the CPU"}[placement]


def place(side, placement: str, device: torch.device) -> None:
    """Load the encoder into `side` where `placement` says."""
    if placement == "gpu":
        side.encoder, side.device = side.load(device), device
    elif placement == "cpu":
        side.encoder, side.device = side.load("cpu"), torch.device("cpu")
    elif placement == "offload":
        encoder = side.load("cpu")
        _offload(encoder, side.layers(encoder), device)
        side.encoder, side.device = encoder, device
    elif placement == "sharded":
        encoder = side.load("cpu")
        _shard(encoder, side.layers(encoder), device)
        side.encoder, side.device = encoder, device
    else:
        raise ValueError(f"unknown text encoder placement {placement!r}")


class PlacedEncoder:
    """`side.encode` for the cache, placing the encoder on first use (a rank without texts never loads
    one). A sharded encoder's forwards are collective, so each rank first says whether it has texts, and
    `drain` keeps a finished rank running forwards until every rank has finished."""

    def __init__(self, side, placement: str, device: torch.device) -> None:
        self.side, self.placement, self.device = side, placement, device
        self.collective = placement == "sharded"
        self.load_seconds = 0.0

    def place(self) -> None:
        if self.side.encoder is None:
            started = time.perf_counter()
            place(self.side, self.placement, self.device)
            self.load_seconds += time.perf_counter() - started

    def __call__(self, captions):
        if self.collective:
            self._others_busy(1)
        self.place()
        return self.side.encode(captions)

    def drain(self) -> None:
        if not self.collective:
            return
        while self._others_busy(0):
            self.side.encode([""])  # a throw-away forward: its output is dropped

    def _others_busy(self, mine: int) -> bool:
        flag = torch.tensor([mine], dtype=torch.int64, device=self.device)
        return bool(du.all_reduce_sum_tensor(flag).item())


def _offload(encoder: torch.nn.Module, layers: list[torch.nn.Module], device: torch.device) -> None:
    """Everything but the decoder layers on `device`; each layer's weights stay in (pinned) host memory and
    are copied to `device` just before the layer runs, then dropped."""
    inside = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    for module in encoder.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if id(tensor) not in inside:
                tensor.data = tensor.data.to(device)
    if device.type != "cuda":
        return  # nothing to move on a CPU run; the hooks would only copy in place
    for layer in layers:
        tensors = [*layer.parameters(), *layer.buffers()]
        host = [t.data.pin_memory() for t in tensors]
        for tensor, pinned in zip(tensors, host):
            tensor.data = pinned

        def bring(module, args, tensors=tensors, host=host):
            for tensor, pinned in zip(tensors, host):
                tensor.data = pinned.to(device, non_blocking=True)

        def drop(module, args, output, tensors=tensors, host=host):
            for tensor, pinned in zip(tensors, host):
                tensor.data = pinned

        layer.register_forward_pre_hook(bring)
        layer.register_forward_hook(drop)


def _shard(encoder: torch.nn.Module, layers: list[torch.nn.Module], device: torch.device) -> None:
    """FSDP2 over the decoder layers and the rest as the root: each rank keeps 1/N of every weight on its
    GPU and a layer's whole weights exist only while it runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (du.world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(encoder, mesh=mesh)
