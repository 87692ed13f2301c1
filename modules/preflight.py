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


def check_model(cfg: TrainConfig) -> tuple[str, ...]:
    """The base model is readable; returns the families it may be (one, or SD 1.x and 2.x, whose folders
    look alike: only loading tells them apart)."""
    from modules.config.model_families import BUILTIN_MODELS
    requested = cfg.model.model_type
    if cfg.model.base_model.strip() in BUILTIN_MODELS and not cfg.model.vae_path.strip():
        if cfg.multi_gpu.enabled and cfg.multi_gpu.nnodes > 1 and cfg.multi_gpu.node_rank > 0:
            build_builtin_model(cfg.model.base_model.strip())
        # built by rank 0 on first use, nothing on disk to check (and no need to import the model package)
        return (BUILTIN_MODELS[cfg.model.base_model.strip()],)
    from modules.model.probe import probe_families
    try:
        families = probe_families(cfg.model)
    except (ValueError, OSError) as e:
        raise PreflightError(str(e)) from None
    return (requested,) if requested in families else families


def check_lora_init(cfg: TrainConfig) -> None:
    """A `training.lora_init` file whose header is damaged is named now, not by every worker after the model
    loaded (58-122 s later, as safetensors' "header too large", naming neither the field nor the file)."""
    init = cfg.training.lora_init.strip()
    if cfg.training.method != "lora" or not init:
        return  # validation refuses the file with another method
    from modules.model.probe import probe_lora_file
    try:
        probe_lora_file(Path(init).expanduser())
    except ValueError as e:
        raise PreflightError(str(e)) from None


def check_family(cfg: TrainConfig, families: tuple[str, ...], context_parallel: int = 1) -> None:
    """What the model's family rules out, found before any worker loads the model: splitting each sample over
    `context_parallel` processes, and video clips in the data of a family that trains images only. Where
    `families` holds several (SD 1.x or 2.x), a problem all of them share."""
    from modules.config.validation import context_parallel_family_problem
    if not families:
        return
    unable = [context_parallel_family_problem(context_parallel, family) for family in families]
    if all(unable):
        raise PreflightError(unable[0])
    check_no_clips(cfg, families)


def check_no_clips(cfg: TrainConfig, families: tuple[str, ...]) -> None:
    """Clips in the concepts of an image family are refused (as the loaded family would, `check_clips`), each
    concept named: the scan would otherwise judge them by `data.video_frames`, a setting such a model never
    uses, and skip the short ones with a warning about it."""
    from modules.config.model_families import FAMILIES
    if any(FAMILIES[family].video for family in families if family in FAMILIES):
        return
    from modules.data.concepts import clip_files
    for index, concept in enumerate(cfg.data.concepts):
        if not concept.enabled:
            continue
        try:
            clips = clip_files(concept)
        except ValueError:
            continue  # an unknown built-in dataset or an empty path: the scan names it
        if clips:
            names = ", ".join(c.name for c in clips[:3]) + (f" and {len(clips) - 3} more" if len(clips) > 3 else "")
            title = " or ".join(FAMILIES[family].title for family in families if family in FAMILIES)
            video = ", ".join(info.title for info in FAMILIES.values() if info.video)
            raise PreflightError(
                f"data.concepts[{index}].path: {concept.path!r} holds {len(clips)} video clip(s) ({names}), but "
                f"{cfg.model.base_model.strip()!r} is {title}, which trains images only; move the clips out of "
                f"the folder, or train a video model ({video}).")


def build_builtin_model(name: str) -> None:
    """Build a built-in model on this machine now, in the launcher. Rank 0 builds it for the workers of its own
    machine; every other machine needs its own copy on its own disk, and a worker there cannot write it:
    transformers saves a text encoder only on rank 0 of a process group."""
    from modules.config.model_families import family_of_builtin
    from modules.model.families import family
    family(family_of_builtin(name)).build_demo()


def preflight(cfg: TrainConfig, context_parallel: int = 1) -> None:
    """Every check that needs neither the world size nor a GPU; raises `PreflightError`. `context_parallel`:
    the processes that split each sample, as the launch resolved it (1 in one process)."""
    check_folders(cfg)
    families = check_model(cfg)
    check_lora_init(cfg)
    check_family(cfg, families, context_parallel)
