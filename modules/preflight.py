"""Checks made once, before any training process starts.

A run that cannot work should fail in seconds with one message saying what to change, not after
every rank has loaded the model and each printed its own traceback. Both entry points run these
(`single_run.run_single` and `distributed/launch.launch`); the multi-process launcher adds what needs the world size
(the machine's GPUs, the port, whether the data fills a global batch).
"""
from __future__ import annotations

import os
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


def check_creatable(folder: Path, field: str) -> None:
    """`folder` exists and is writable, or could be created: its nearest existing ancestor is a writable
    folder. Nothing is created (a folder made for a run that then fails would be litter)."""
    folder = Path(folder).absolute()
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise PreflightError(f"{field}: cannot create {folder}: {existing} is a file, not a folder; choose another "
                             "folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write to" if existing == folder else f"create {folder} in"
        raise PreflightError(f"{field}: cannot {what} {existing} (permission denied); choose a folder you can "
                             "write to, or fix its permissions.")


def check_folders(cfg: TrainConfig) -> None:
    """The run folder (backups, samples, logs) and the cache must be writable before training starts, and
    the output folder must be one that can be made: it is written at the end, where a full disk still fails
    (a failed final save keeps the weights as a backup), but a path that can never work is said now."""
    paths = RunPaths(cfg)
    check_writable(paths.workspace, "general.workspace_dir")
    if cfg.data.cache_latents or cfg.data.cache_text_embeddings:
        field = "general.cache_dir" if cfg.general.cache_dir.strip() else "general.workspace_dir (its cache folder)"
        check_writable(paths.cache, field)
    field = "save.output_dir" if cfg.save.output_dir.strip() else "general.workspace_dir (its output folder)"
    check_creatable(paths.output_dir, field)


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
