"""Checks made once, before any training process starts.

A run that cannot work should fail in seconds with one message saying what to change, not after
every rank has loaded the model and each printed its own traceback. Both entry points run these
(`launch.run_single` and `launch.launch`); the multi-process launcher adds what needs the world size
(the machine's GPUs, the port, whether the data fills a global batch).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from modules.config import RunPaths, TrainConfig


class PreflightError(RuntimeError):
    """A problem found before any training process started; the message says what to change."""


def check_writable(folder: Path, field: str) -> None:
    """Create `folder` if needed and make sure a file can be written in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise PreflightError(f"{field}: cannot write to {folder} ({e.strerror or e}); choose a folder you can "
                             "write to, or fix its permissions.") from None


def check_folders(cfg: TrainConfig) -> None:
    """The run folder (backups, samples, logs) and the cache must be writable before training starts.
    (The output folder is written at the end; a failed final save keeps the weights as a backup.)"""
    paths = RunPaths(cfg)
    check_writable(paths.workspace, "general.workspace_dir")
    if cfg.data.cache_latents or cfg.data.cache_text_embeddings:
        field = "general.cache_dir" if cfg.general.cache_dir.strip() else "general.workspace_dir (its cache folder)"
        check_writable(paths.cache, field)


def check_model(cfg: TrainConfig) -> None:
    from modules.config.model_families import BUILTIN_MODELS
    if cfg.model.base_model.strip() in BUILTIN_MODELS and not cfg.model.vae_path.strip():
        if cfg.multi_gpu.enabled and cfg.multi_gpu.nnodes > 1 and cfg.multi_gpu.node_rank > 0:
            build_builtin_model(cfg.model.base_model.strip())
        return  # built by rank 0 on first use, nothing on disk to check (and no need to import the model package)
    from modules.model.probe import probe_model
    try:
        probe_model(cfg.model)
    except (ValueError, OSError) as e:
        raise PreflightError(str(e)) from None


def build_builtin_model(name: str) -> None:
    """Build a built-in model on this machine now, in the launcher. Rank 0 builds it for the workers of its own
    machine; every other machine needs its own copy on its own disk, and a worker there cannot write it:
    transformers saves a text encoder only on rank 0 of a process group."""
    from modules.config.model_families import family_of_builtin
    from modules.model.families import family
    family(family_of_builtin(name)).build_demo()


def preflight(cfg: TrainConfig) -> None:
    """Every check that needs neither the world size nor a GPU; raises `PreflightError`."""
    check_folders(cfg)
    check_model(cfg)
