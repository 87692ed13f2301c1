"""Which denoiser graphs PyTorch's compile cache holds, as Tandem compiled them: one small file per graph.

PyTorch's own cache is keyed by the traced graph, which exists only after minutes of tracing; whether a run
would be served from it cannot be asked beforehand. So after each compile of a batch shape Tandem notes the
run's signature (`compile_choice`/`compiled_unet`: the model's trained and frozen weights, dtypes,
checkpointing, CUDA graphs, torch, the GPU) with that shape, in `tandem-graphs/` inside the compile cache folder
in use: emptying that folder empties both. `training.compile` auto reads the note to know a compile will come
from the cache and how long it took here.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from modules.util.atomic import write_text_atomically
from modules.util.compile_cache import VARIABLE, default_folder

log = logging.getLogger(__name__)

FOLDER = "tandem-graphs"


def ledger_folder() -> Path:
    """`tandem-graphs/` in the compile cache folder this process uses (`compile_cache.keep_compile_cache`)."""
    return Path(os.environ.get(VARIABLE) or default_folder()) / FOLDER


def _entry(signature: str, shape: tuple[int, ...]) -> Path:
    key = hashlib.sha256(json.dumps([signature, list(shape)]).encode()).hexdigest()[:32]
    return ledger_folder() / f"{key}.json"


def noted(signature: str, shape: tuple[int, ...]) -> dict | None:
    """The note of a compile of `signature` at `shape` (`seconds`, `from_cache`), None where there is none."""
    try:
        return json.loads(_entry(signature, shape).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def note_compiled(signature: str, shape: tuple[int, ...], seconds: float, from_cache: bool) -> None:
    """Note that this compile is now in the cache. A compile served from the cache keeps its time as what the next
    one will cost; a cold compile keeps an earlier cached time. A note that cannot be written only costs a later
    run its estimate: said at debug level."""
    earlier = noted(signature, shape) or {}
    entry = {"shape": list(shape), "written": time.strftime("%Y-%m-%d %H:%M:%S"),
             "cold_s": earlier.get("cold_s"), "cached_s": earlier.get("cached_s")}
    entry["cached_s" if from_cache else "cold_s"] = round(seconds, 1)
    try:
        path = _entry(signature, shape)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(entry))
    except OSError as error:
        log.debug("Could not note the compiled graph in %s: %s", ledger_folder(), error)
